"""The song worker (serve/worker.py): one attempt of a job in, the song's events out, its final event in plain
values (a verified result, or the error in words) — what a single-process server and every Ray replica hold."""
import json
import queue
import threading

from yue2_vllm.artifacts import verify_result
from yue2_vllm.protocol import SongRequest
from yue2_vllm.options import AROptions, EngineOptions, LoadOptions
from yue2_vllm.serve.worker import SongOrder, SongWorker

from serving import pipe  # noqa: F401 (a fixture)

FINAL = ("complete", "failed", "cancelled")


def order(tmp_path, job_id="j" + "1" * 20, attempt=1, stage="audio", **request) -> SongOrder:
    song = SongRequest(style="pop, piano", lyrics="[verse]\nla la la\n", seed=7, id=job_id, **request)
    return SongOrder(job_id, attempt, song.to_dict(), {}, stage, str(tmp_path / job_id))


def run(worker: SongWorker, events: queue.Queue, song: SongOrder) -> list:
    worker.submit(song)
    seen = []
    while not seen or seen[-1].kind not in FINAL:
        seen.append(events.get(timeout=120))
    return seen


def test_a_complete_song_comes_back_verified_in_plain_values(pipe, tmp_path):  # noqa: F811
    events: queue.Queue = queue.Queue()
    worker = SongWorker(pipe, concurrency=2, listener=events.put)
    worker.start()
    try:
        song = order(tmp_path)
        seen = run(worker, events, song)
        kinds = [event.kind for event in seen]
        assert kinds[0] == "state" and kinds[-1] == "complete"
        assert {"tokens", "stage_done", "score", "nar", "vae"} <= set(kinds)
        end = seen[-1].data
        document = verify_result(song.directory)
        assert end["error"] is None and end["engine_failure"] is False
        assert end["result"]["identity"] == document["identity"]
        assert end["result"]["audio_bytes"] == document["artifacts"]["audio.flac"]["bytes"]
        json.dumps(end)  # nothing in it that cannot cross a process boundary
        # The same job again resumes: every stage reused, the same identity.
        again = run(worker, events, SongOrder(**{**song.to_dict(), "attempt": 2}))
        assert again[-1].kind == "complete" and again[-1].data["result"]["resumed"] is True
        health = worker.health()
        assert health["engine"]["state"] == "none" and health["problems"] == [] and health["concurrency"] == 2
        assert worker.down_for_good() is None
    finally:
        assert worker.close(timeout=30)


class Tampering(SongWorker):
    """A worker whose songs' audio changes on disk between the song's end and the check."""

    def verify(self, handle):
        path = handle.directory / "audio.flac"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        return super().verify(handle)


def test_a_song_whose_files_do_not_verify_ends_failed_not_complete(pipe, tmp_path):  # noqa: F811
    events: queue.Queue = queue.Queue()
    worker = Tampering(pipe, concurrency=1, listener=events.put)
    try:
        end = run(worker, events, order(tmp_path))[-1]
        assert end.kind == "failed" and end.data["error"]["type"] == "VerificationError"
        assert "do not verify" in end.data["error"]["message"]
    finally:
        worker.close(timeout=30)


def test_a_cancelled_song_says_so_and_a_plan_job_verifies_its_plan(pipe, tmp_path):  # noqa: F811
    events: queue.Queue = queue.Queue()
    worker = SongWorker(pipe, concurrency=1, listener=events.put)
    try:
        blocker = order(tmp_path, "j" + "2" * 20)
        waiting = order(tmp_path, "j" + "3" * 20)
        worker.submit(SongOrder(**{**blocker.to_dict(), "overrides": {"semantic": {"min_tokens": 3000,
                                                                                    "max_tokens": 3000}}}))
        handle = worker.submit(waiting)
        assert handle.cancel()  # queued behind the first: cancelled at once
        ends = {}
        started = threading.Event()
        while len(ends) < 2:
            event = events.get(timeout=120)
            if event.kind == "tokens" and event.song.id == blocker.job_id and not started.is_set():
                started.set()
                worker.scheduler.cancel(blocker.job_id)
            if event.kind in FINAL:
                ends[event.song.id] = event
        for job_id in (blocker.job_id, waiting.job_id):
            assert ends[job_id].kind == "cancelled" and ends[job_id].data["result"] is None
            assert ends[job_id].data["error"]["type"] in ("InterruptedError", "Cancelled")
        plan = run(worker, events, order(tmp_path, "j" + "4" * 20, stage="plan"))[-1]
        assert plan.kind == "complete" and plan.data["result"]["identity"]
    finally:
        worker.close(timeout=30)


def test_a_failed_first_engine_start_is_in_the_health_words_with_its_next_try(tiny_model_dir, tiny_vae_dir,
                                                                             tmp_path, monkeypatch):
    import pytest

    from yue2_vllm.checkpoint import HashCache
    from yue2_vllm.engine.backend import vllm_version
    from yue2_vllm.pipeline import YuE2Pipeline

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    monkeypatch.setenv("YUE2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("YUE2_TEST_ENGINE_START_DELAY_S", "60")  # a cold start longer than the timeout below
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, load=LoadOptions(hash_cache=HashCache(None)),
                        ar=AROptions(backend="vllm"), engine=EngineOptions(start_timeout_s=1.0))
    worker = SongWorker(pipe)
    try:
        assert worker.health()["engine"]["state"] == "starting"  # 503 until the first start has an outcome
        worker.watch_engine()
        health = worker.health()
        engine = health["engine"]
        assert health["problems"] == []  # songs are served, on the torch backend, on the record
        assert (engine["state"], engine["backend"], engine["failed_starts"], engine["retrying"]) == \
            ("start_failed", "torch", 1, False)
        assert engine["reason"].startswith("vLLM engine could not start: vLLM engine did not start within 1 s")
        assert 55 <= engine["next_retry_seconds"] <= 60
    finally:
        worker.close(timeout=10)
        pipe.close()
