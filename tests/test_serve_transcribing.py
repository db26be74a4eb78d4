"""The server's transcription pool (serve/transcribing.py) and what it starts. Where SheetSage2 may run is the
operator's (`--sheetsage-device`, else $YUE2_SHEETSAGE_DEVICE), carried into the pool's spawned processes.
SheetSage2 runs in a child of a pool worker (subprocess.run), so ending the pool — the server stopping, or a worker
killed — ends that child too, with its memory. SheetSage2's environment is a stand-in here: a "python" that
records its pid and its parent's, then sleeps as a long transcription would."""
import asyncio
import os
import signal
import time

import pytest

from melodies import synthesize, wav_bytes
from serving import alive, wait_for
from test_transcription_pyin import TWINKLE
from yue2_vllm.cli import build_parser
from yue2_vllm.serve.errors import Unavailable
from yue2_vllm.serve.transcribing import TranscriptionPool

HUM = wav_bytes(synthesize(TWINKLE, 100))


@pytest.fixture
def sleeping_sheetsage(monkeypatch, tmp_path):
    """SheetSage2 set up with a worker that never answers; yields the file its pid and its parent's land in, and
    kills whatever of it is still running at the end."""
    pids = tmp_path / "pids"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho $$ $PPID > {pids}.tmp && mv {pids}.tmp {pids}\nexec sleep 600\n")
    python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", str(python))  # the pool's processes inherit the environment
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(model))
    yield pids
    if pids.exists():
        for pid in map(int, pids.read_text().split()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def running(pool, pids, then):
    """Start a SheetSage2 transcription in `pool`, wait until its worker runs, call `then(worker pid, pool worker
    pid)`; the call's error, and the SheetSage2 worker's pid."""

    async def run():
        call = asyncio.ensure_future(pool.transcribe(HUM, {"transcriber": "sheetsage2"}))
        deadline = time.monotonic() + 120
        while not pids.exists():
            assert not call.done() and time.monotonic() < deadline, "SheetSage2's worker did not start"
            await asyncio.sleep(0.05)
        worker, parent = map(int, pids.read_text().split())
        then(worker, parent)
        with pytest.raises(Exception) as error:
            await asyncio.wait_for(call, 60)
        return error.value, worker

    return asyncio.run(run())


def test_closing_the_pool_ends_a_running_sheetsage2_worker(sleeping_sheetsage):
    pool = TranscriptionPool(1, 0)
    try:
        _, worker = running(pool, sleeping_sheetsage, lambda worker, parent: pool.close())
    finally:
        pool.close()
    assert not wait_for(lambda: alive(worker), lambda up: not up, timeout=10)


def test_a_killed_pool_worker_takes_its_sheetsage2_worker_with_it(sleeping_sheetsage):
    """A pool worker killed (out of memory) while SheetSage2 runs: the call is a 503, and SheetSage2 is gone too."""
    pool = TranscriptionPool(1, 0)
    try:
        error, worker = running(pool, sleeping_sheetsage,
                                lambda worker, parent: os.kill(parent, signal.SIGKILL))
        assert isinstance(error, Unavailable) and "worker died" in str(error), error
        assert not wait_for(lambda: alive(worker), lambda up: not up, timeout=10)
    finally:
        pool.close()


def test_sheetsage2_turned_off_on_the_server_is_a_503_naming_it(monkeypatch):
    monkeypatch.delenv("YUE2_SHEETSAGE_DEVICE", raising=False)
    assert build_parser().parse_args(["serve", "--sheetsage-device", "off"]).sheetsage_device == "off"
    assert build_parser().parse_args(["serve"]).sheetsage_device is None  # $YUE2_SHEETSAGE_DEVICE, else auto
    pool = TranscriptionPool(1, 0, sheetsage_device="off")
    try:
        with pytest.raises(Unavailable) as caught:
            asyncio.run(pool.transcribe(b"not even audio", {"transcriber": "sheetsage2"}))
    finally:
        pool.close()
    assert (caught.value.status, caught.value.field) == (503, "transcriber")
    assert caught.value.message.startswith("sheetsage2: turned off here (device off)")
