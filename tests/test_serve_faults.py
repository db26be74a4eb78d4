"""The serving core under faults, as its users meet them: cancels and deletes racing a song's end, a job that kills the
server, an engine down for good, a wedged engine, kill -9 of the server, many long-lyric songs at once."""
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serving import ProcessServer, ThreadServer, alive, wait_for
from yue2_vllm.artifacts import verify_result
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.options import AROptions, EngineOptions

FINAL = ("complete", "failed", "cancelled")
GENERATION = {"abc": {"max_tokens": 6, "min_tokens": 6}, "semantic": {"max_tokens": 12, "min_tokens": 12},
              "ode_steps": 2}
SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
LONG = {"semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}  # runs until something stops it
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")


def submit(client, **body) -> dict:
    response = client.post("/v1/songs", json={**SONG, **body})
    assert response.status_code == 202, response.text
    return response.json()


def status(client, job_id) -> dict:
    return client.get(f"/v1/songs/{job_id}").json()


def final(client, job_id, timeout=300) -> dict:
    return wait_for(lambda: status(client, job_id), lambda d: d["status"] in FINAL, timeout)


def server_args(tmp_path, *more) -> list[str]:
    """A fresh data dir and short songs (the tiny default's 10-second songs would make these tests slow)."""
    config = tmp_path / "generation.json"
    config.write_text(json.dumps(GENERATION), encoding="utf-8")
    return ["--data-dir", str(tmp_path / "data"), "--config", str(config), *more]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text(encoding="utf-8").split()]
    return found


def test_cancels_racing_the_ends_of_songs_never_wedge_the_server(tmp_path):
    """13 songs at --max-concurrency 4, each cancelled ~20 times while it synthesizes or decodes: every cancel
    answers, a POST afterwards answers within 5 s, every song ends, and SIGTERM stops the server within 30 s."""
    server = ProcessServer(server_args(tmp_path, "--max-concurrency", "4", "--backend", "torch"),
                           log=tmp_path / "serve.log")
    client = server.client
    try:
        server.wait_healthy()
        jobs = [submit(client)["id"] for _ in range(13)]
        answered = []

        def hammer(job_id: str) -> None:
            doc = wait_for(lambda: status(client, job_id),
                           lambda d: d["status"] in ("synthesizing", "decoding") + FINAL, timeout=300)
            if doc["status"] in FINAL:
                return
            for _ in range(20):
                answered.append(client.post(f"/v1/songs/{job_id}/cancel").status_code)

        with ThreadPoolExecutor(13) as pool:
            list(pool.map(hammer, jobs))
        assert answered and set(answered) <= {200, 202}
        started = time.monotonic()
        assert client.post("/v1/songs", json=SONG).status_code == 202
        assert time.monotonic() - started < 5
        for job_id in jobs:
            assert final(client, job_id)["status"] in ("cancelled", "complete")
        assert client.get("/health").status_code == 200
        started = time.monotonic()
        assert server.stop(timeout=30) == 0 and time.monotonic() - started < 30
    finally:
        if server.process.poll() is None:
            server.kill()


@pytest.mark.slow  # cancels racing the ends of songs stay
def test_deletes_racing_the_ends_of_songs_remove_every_job_and_keep_the_server_healthy(tmp_path):
    """8 songs at --max-concurrency 4, each DELETEd by two clients at once while it synthesizes, decodes or has
    just ended, while a third keeps reading it: one DELETE of each answers 202 or 204 and the other 404,
    every read after the first answer is 404 and none is a 5xx, every job's row and files go, a job nobody
    deleted keeps its files, and the server stays healthy."""
    server = ProcessServer(server_args(tmp_path, "--max-concurrency", "4", "--backend", "torch"),
                           log=tmp_path / "serve.log")
    client, jobs_dir = server.client, tmp_path / "data" / "jobs"
    rng = random.Random(29)
    try:
        server.wait_healthy()
        kept = submit(client)["id"]
        jobs = [submit(client, seed=n)["id"] for n in range(8)]
        # Seconds after it reached synthesis: none (its run is stopped), up to 0.4 (at its end), or once it ended.
        delays = {job_id: 0.0 if n == 0 else rng.uniform(0, 0.4) if n % 2 else None for n, job_id in enumerate(jobs)}
        answers: dict[str, list[int]] = {job_id: [] for job_id in jobs}
        removed_at: dict[str, float] = {}  # when the first DELETE of the job was answered
        reads: list[tuple[str, float, int]] = []  # (job, when the read was sent, its status)

        def delete(job_id: str) -> None:
            code = client.delete(f"/v1/songs/{job_id}").status_code
            if code in (202, 204):
                removed_at[job_id] = time.monotonic()
            answers[job_id].append(code)

        def read(job_id: str, until: float) -> None:
            while time.monotonic() < until:
                for path in ("", "/audio", "/result", "/events"):
                    sent = time.monotonic()
                    reads.append((job_id, sent, client.get(f"/v1/songs/{job_id}{path}").status_code))

        def race(job_id: str) -> None:
            wait_for(lambda: status(client, job_id),
                     lambda d: d["status"] in ("synthesizing", "decoding") + FINAL, timeout=300, interval=0.01)
            if delays[job_id] is None:
                wait_for(lambda: status(client, job_id), lambda d: d["status"] in FINAL, timeout=300, interval=0.01)
            else:
                time.sleep(delays[job_id])
            with ThreadPoolExecutor(3) as pool:
                reader = pool.submit(read, job_id, time.monotonic() + 1.0)
                for future in [pool.submit(delete, job_id) for _ in range(2)]:
                    future.result()
                after = client.get(f"/v1/songs/{job_id}").status_code
                reader.result()
            assert after == 404, (job_id, after)

        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(race, jobs))
        for job_id, codes in answers.items():
            assert sorted(codes) in ([202, 404], [204, 404]), (job_id, codes)
            if delays[job_id] is None:  # it had ended: nothing was running
                assert 204 in codes, (job_id, codes)
        assert 202 in answers[jobs[0]]  # stopped mid-run: removed once it stopped
        codes = {code for _, _, code in reads}
        assert codes <= {200, 404, 409}, sorted(codes)  # never a 5xx, a download cut short included
        late = [(job_id, code) for job_id, sent, code in reads if sent > removed_at[job_id] and code != 404]
        assert not late, late  # once a DELETE was answered, every read is 404
        wait_for(lambda: sorted(p.name for p in jobs_dir.iterdir()), lambda names: names == [kept], timeout=120)
        listed = client.get("/v1/songs", params={"limit": 100}).json()["songs"]
        assert [song["id"] for song in listed] == [kept]
        assert final(client, kept)["status"] == "complete"
        verify_result(jobs_dir / kept)
        assert client.get("/health").status_code == 200
        assert final(client, submit(client)["id"])["status"] == "complete"  # and it goes on serving
        assert server.stop(timeout=30) == 0
    finally:
        if server.process.poll() is None:
            server.kill()


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_a_job_that_kills_the_server_twice_is_failed_not_looped(tmp_path):
    args = server_args(tmp_path, "--backend", "torch")
    server = ProcessServer(args, log=tmp_path / "serve.log")
    job = submit(server.client, **LONG)["id"]
    for death in (1, 2):
        wait_for(lambda: status(server.client, job), lambda d: d["status"] == "generating", timeout=120)
        server.kill()  # kill -9 while it runs: as if the song itself brought the server down
        server = ProcessServer(args, log=tmp_path / "serve.log")
        if death == 1:
            assert status(server.client, job)["retries"][-1]["kind"] == "restart"
    try:
        doc = final(server.client, job, timeout=60)
        assert doc["status"] == "failed" and doc["error"]["type"] == "Interrupted"
        assert "died 2 times while this job was running" in doc["error"]["message"]
        assert [r["kind"] for r in doc["retries"]] == ["restart"]
        assert submit(server.client)["status"] == "queued"  # the server itself goes on
    finally:
        server.kill()


def test_sigterm_requeues_running_jobs_as_a_shutdown_not_a_death(tmp_path):
    args = server_args(tmp_path, "--backend", "torch")
    for attempt in range(3):  # three graceful restarts mid-song: never counted as deaths
        server = ProcessServer(args, log=tmp_path / "serve.log")
        if attempt == 0:
            job = submit(server.client, **LONG)["id"]
        wait_for(lambda: status(server.client, job), lambda d: d["status"] == "generating", timeout=120)
        assert server.stop(timeout=30) == 0
    server = ProcessServer(args, log=tmp_path / "serve.log")
    try:
        doc = wait_for(lambda: status(server.client, job), lambda d: d["status"] == "generating", timeout=120)
        assert [r["kind"] for r in doc["retries"]] == ["shutdown"] * 3
        assert doc["started"] is not None
    finally:
        server.kill()


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_the_engine_worker_dies_with_a_killed_server(tmp_path):
    server = ProcessServer(server_args(tmp_path, "--backend", "vllm"), log=tmp_path / "serve.log")
    try:
        health = server.wait_healthy()
        assert health["engine"]["state"] == "running"
        workers = [pid for pid in children(server.process.pid) if alive(pid)]
        assert workers, "no engine worker process found"
    finally:
        server.kill()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "the engine worker outlived its server by 5 s"


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_while_the_engine_is_down_for_good_queued_jobs_stay_queued(tiny_model_dir, tiny_vae_dir, tmp_path):
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm"),
                        engine=EngineOptions(max_num_seqs=2, max_num_batched_tokens=64, start=True,
                                             tuning={"max_restarts": 0}))
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1, engine_retries=0)))
    client = server.client
    try:
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=300)
        running = submit(client, **LONG)["id"]
        waiting = [submit(client)["id"] for _ in range(2)]
        wait_for(lambda: status(client, running), lambda d: d["progress"]["semantic"]["tokens"] >= 10, timeout=120)
        os.killpg(pipe.engine.process.pid, signal.SIGKILL)
        down = wait_for(lambda: client.get("/health"), lambda r: r.json()["engine"]["state"] == "failed", timeout=60)
        assert down.status_code == 503 and any("the AR engine is failed" in p for p in down.json()["problems"])
        time.sleep(3)  # the held jobs stay held: nothing runs them into the dead engine
        for job_id in [running, *waiting]:
            assert status(client, job_id)["status"] == "queued", status(client, job_id)
        assert client.get("/health").json()["queue"]["held"] == 3
        assert client.post("/v1/songs", json=SONG).status_code == 503  # and new ones are told why
    finally:
        server.stop()
        pipe.close()


@needs_vllm
def test_health_is_503_while_songs_in_flight_make_no_progress(tiny_model_dir, tiny_vae_dir, engines, tmp_path):
    """A wedged engine (SIGSTOP) with a song in flight: /health says so within the stall bound, and recovers (the
    shared engine: stopped for seconds, then continued, it serves on)."""
    pipe = engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm"))
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1, stall_seconds=3)))
    client = server.client
    try:
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=300)
        job = submit(client, **LONG)["id"]
        wait_for(lambda: status(client, job), lambda d: d["progress"]["semantic"]["tokens"] >= 10, timeout=120)
        worker = pipe.engine.process.pid
        os.kill(worker, signal.SIGSTOP)
        try:
            wedged = wait_for(lambda: client.get("/health"), lambda r: r.status_code == 503, timeout=30)
            assert any("no song has made progress" in p for p in wedged.json()["problems"])
            assert wedged.json()["engine"]["state"] == "running"  # the process is up: only progress tells
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=60)
        client.post(f"/v1/songs/{job}/cancel")
        assert final(client, job)["status"] == "cancelled"
    finally:
        server.stop()
        pipe.close()


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_sixteen_long_lyric_songs_at_once_on_the_engine(tiny_model_dir, tiny_vae_dir, tmp_path):
    """16 songs with ~10k-character lyrics (prompts over 2,048 tokens, ~30 KB engine commands) at once."""
    sections = [f"[{'verse' if i % 2 else 'chorus'}]\n" + "\n".join(
        f"walking down the long river road number {i} line {j} singing softly" for j in range(4)) for i in range(40)]
    lyrics = "\n".join(sections) + "\n"
    assert 10000 < len(lyrics) < 12000
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm"),
                        engine=EngineOptions(max_num_seqs=16, start=True))
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=16)))
    client = server.client
    try:
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=300)
        jobs = [submit(client, lyrics=lyrics, seed=i)["id"] for i in range(16)]
        for job_id in jobs:
            doc = final(client, job_id, timeout=600)
            assert doc["status"] == "complete", doc["error"]
            assert doc["stages"]["semantic"]["backend_actual"] == "vllm"
            verify_result(tmp_path / "data" / "jobs" / job_id)
    finally:
        server.stop()
        pipe.close()


@pytest.mark.slow  # kill -9 mid-song and restart stays in tests/test_serve.py
def test_kill_9_soak_loses_no_job_and_completes_none_twice(tmp_path):
    """24 jobs; the server is killed (SIGKILL) at 3 random moments and restarted each time."""
    args = server_args(tmp_path, "--max-concurrency", "4", "--backend", "torch")
    server = ProcessServer(args, log=tmp_path / "serve.log")
    jobs = [submit(server.client, seed=i)["id"] for i in range(24)]
    completed_at: dict[str, str] = {}
    rng = random.Random(5)
    for _ in range(3):
        time.sleep(rng.uniform(2, 8))
        for job_id in jobs:
            doc = status(server.client, job_id)
            if doc["status"] == "complete":
                completed_at.setdefault(job_id, doc["finished"])
        server.kill()
        server = ProcessServer(args, log=tmp_path / "serve.log")
    try:
        for job_id in jobs:
            doc = final(server.client, job_id, timeout=600)
            assert doc["status"] == "complete", (job_id, doc["error"])
            verify_result(tmp_path / "data" / "jobs" / job_id)
            if job_id in completed_at:  # complete before a kill: never run again (a second run would finish anew)
                assert doc["finished"] == completed_at[job_id]
                assert all(retry["at"] <= doc["finished"] for retry in doc["retries"])
        listed = {song["id"] for song in server.client.get("/v1/songs", params={"limit": 100}).json()["songs"]}
        assert set(jobs) <= listed
    finally:
        server.kill()


def test_delete_retention_and_the_free_disk_bound(tiny_model_dir, tiny_vae_dir, tmp_path, monkeypatch):
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION)
    service = SongService(pipe, ServeConfig(tmp_path / "data", retention_seconds=3600))
    server = ThreadServer(service)
    client = server.client
    try:
        done = submit(client)["id"]
        old = submit(client, stage="plan")["id"]
        assert final(client, done)["status"] == final(client, old)["status"] == "complete"
        assert client.delete(f"/v1/songs/{done}").status_code == 204
        assert client.get(f"/v1/songs/{done}").status_code == 404
        assert not (tmp_path / "data" / "jobs" / done).exists()
        assert client.delete(f"/v1/songs/{done}").status_code == 404
        # Retention: a finished job older than the window goes at the next sweep.
        service.store.update(old, finished=time.time() - 7200)
        service._call(service._sweep)
        assert client.get(f"/v1/songs/{old}").status_code == 404
        assert not (tmp_path / "data" / "jobs" / old).exists()
        assert 'yue2_jobs_purged_total 2.0' in client.get("/metrics").text
        # Under the free-disk bound, admission is 507 and nothing is queued.
        monkeypatch.setattr(service.config, "min_free_bytes", 1 << 62)
        full = client.post("/v1/songs", json=SONG)
        assert full.status_code == 507 and "MB kept free (--min-free-disk)" in full.json()["error"]["message"]
        assert service.store.queued() == 0
    finally:
        server.stop()
        pipe.close()
