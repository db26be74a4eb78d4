"""`yue2-vllm serve --replicas N` on a real local Ray cluster (Ray Serve replicas, the tiny default): songs
spread over the replicas, a replica killed mid-song, SSE across the move, kill -9 of the ingress, SIGTERM."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from serving import ProcessServer, alive, wait_for
from yue2_vllm.artifacts import verify_result
from yue2_vllm.engine.backend import vllm_version

pytest.importorskip("ray.serve", reason="pip install 'yue2-vllm[ray]'")
httpx_sse = pytest.importorskip("httpx_sse", reason="pip install 'yue2-vllm[test]'")

FINAL = ("complete", "failed", "cancelled")
GENERATION = {"abc": {"max_tokens": 6, "min_tokens": 6}, "semantic": {"max_tokens": 12, "min_tokens": 12},
              "ode_steps": 2}
SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n"}
LONGER = {"semantic_sampling": {"min_tokens": 400, "max_tokens": 400}}  # ~10 s on one core


def server_args(tmp_path: Path, *more: str) -> list[str]:
    config = tmp_path / "generation.json"
    config.write_text(json.dumps(GENERATION), encoding="utf-8")
    return ["--data-dir", str(tmp_path / "data"), "--config", str(config), *more]


def start(tmp_path: Path, replicas: int = 2, backend: str = "torch", *more: str) -> ProcessServer:
    server = ProcessServer(server_args(tmp_path, "--replicas", str(replicas), "--backend", backend, *more),
                           log=tmp_path / "serve.log")
    assert server.status["replicas"] == replicas and server.status["replica_cpus"] == 1
    wait_for(lambda: server.client.get("/health"),
             lambda r: r.status_code == 200 and r.json()["replicas"] == f"{replicas}/{replicas}", timeout=180)
    return server


def submit(client, seed: int, **body) -> str:
    response = client.post("/v1/songs", json={**SONG, "seed": seed, **body})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def status(client, job_id: str) -> dict:
    return client.get(f"/v1/songs/{job_id}").json()


def final(client, job_id: str, timeout: float = 300) -> dict:
    return wait_for(lambda: status(client, job_id), lambda d: d["status"] in FINAL, timeout)


def completed_total(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('yue2_songs_finished_total{status="complete"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replica_pids(client) -> dict[str, int]:
    return {r["replica"]: r["pid"] for r in client.get("/health").json()["replica_states"]}


def engine_worker(replica_pid: int) -> int | None:
    """The replica's engine worker: its child that leads a process group of its own."""
    for task in Path(f"/proc/{replica_pid}/task").iterdir():
        for child in map(int, (task / "children").read_text(encoding="utf-8").split()):
            try:
                if os.getpgid(child) == child and alive(child):
                    return child
            except ProcessLookupError:
                continue
    return None


def test_a_song_on_each_of_two_replicas_and_a_graceful_stop(tmp_path):
    """Ray Serve in the default run: two replicas of the tiny default on the torch backend (a replica's engine is
    the slow run's, below), one song each, the cluster gone with the server's SIGTERM."""
    server = start(tmp_path, 2, "torch", "--max-concurrency", "1")
    client = server.client
    try:
        jobs = [submit(client, seed) for seed in range(2)]
        docs = [final(client, job_id) for job_id in jobs]
        assert [doc["status"] for doc in docs] == ["complete"] * 2, [doc["error"] for doc in docs]
        for job_id in jobs:
            verify_result(tmp_path / "data" / "jobs" / job_id)
        ran = {stage["replica"] for doc in docs for stage in doc["stages"].values()}
        assert ran == set(replica_pids(client)), ran  # one song per replica: each stage names its replica
        pids = list(replica_pids(client).values())
        assert server.stop(timeout=60) == 0
        assert server.process.stdout.read().strip().endswith(b'{"status": "stopped"}')
        assert not any(alive(pid) for pid in pids)  # the local cluster went with the server
    finally:
        if server.process.poll() is None:
            server.kill()


@pytest.mark.slow  # eight songs, a replica's vLLM engine each: 30-55 s here; the two-song test is the default run's
def test_eight_songs_through_two_replicas_and_a_graceful_stop(tmp_path):
    """The tiny default as `serve` runs it (the AR half on vLLM where it is installed), two replicas."""
    backend = "auto" if vllm_version() is not None else "torch"
    server = start(tmp_path, 2, backend, "--max-concurrency", "4")
    client = server.client
    try:
        health = client.get("/health").json()
        assert health["concurrency"] == 8 and len(health["replica_states"]) == 2
        jobs = [submit(client, seed) for seed in range(8)]
        docs = [final(client, job_id) for job_id in jobs]
        assert [doc["status"] for doc in docs] == ["complete"] * 8, [doc["error"] for doc in docs]
        assert {doc["stages"]["semantic"]["backend_actual"] for doc in docs} == {"vllm" if backend == "auto"
                                                                                else "torch"}
        for job_id in jobs:
            verify_result(tmp_path / "data" / "jobs" / job_id)
        ran = {stage["replica"] for doc in docs for stage in doc["stages"].values()}
        assert ran == set(replica_pids(client)), ran  # both replicas ran songs, each stage names its replica
        assert all(not doc["retries"] for doc in docs)
        assert completed_total(client) == 8
        metrics = client.get("/metrics").text
        assert 'yue2_replicas{state="serving"} 2.0' in metrics and 'yue2_replicas{state="wanted"} 2.0' in metrics
        assert sum('yue2_replica_songs_in_flight{replica="' in line for line in metrics.splitlines()) == 2
        # Cancel and delete reach a replica's song through the job board.
        cancelled, deleted = submit(client, 100, **LONGER), submit(client, 101, **LONGER)
        for job_id in (cancelled, deleted):
            wait_for(lambda: status(client, job_id), lambda d: d["status"] == "generating", timeout=120)
        assert client.post(f"/v1/songs/{cancelled}/cancel").status_code == 202
        stopping = client.delete(f"/v1/songs/{deleted}")
        assert stopping.status_code == 202 and client.get(f"/v1/songs/{deleted}").status_code == 404
        assert client.delete(f"/v1/songs/{jobs[0]}").status_code == 204
        assert final(client, cancelled, timeout=60)["status"] == "cancelled"
        wait_for(lambda: (tmp_path / "data" / "jobs" / deleted).exists(), lambda exists: not exists, timeout=60)
        assert not (tmp_path / "data" / "jobs" / jobs[0]).exists()
        assert {song["id"] for song in client.get("/v1/songs").json()["songs"]} == set(jobs[1:]) | {cancelled}
        pids = list(replica_pids(client).values())
        started = time.monotonic()
        assert server.stop(timeout=60) == 0 and time.monotonic() - started < 30
        assert server.process.stdout.read().strip().endswith(b'{"status": "stopped"}')
        assert not any(alive(pid) for pid in pids)  # the local cluster went with the server
    finally:
        if server.process.poll() is None:
            server.kill()


@pytest.mark.slow  # a cluster restart or a replica replaced: 40-140 s here; the two-song test is the default run's
def test_a_replica_killed_mid_song_moves_the_song_and_its_stream_stays_one(tmp_path):
    server = start(tmp_path)
    client = server.client
    try:
        moving = submit(client, 1, **LONGER)
        events: list[tuple[str, str, dict]] = []

        def follow() -> None:
            with httpx_sse.connect_sse(client, "GET", f"/v1/songs/{moving}/events", timeout=300) as source:
                for event in source.iter_sse():
                    if not event.data:  # the heartbeat (a comment: httpx-sse hands it over with the last id)
                        continue
                    events.append((event.id, event.event, json.loads(event.data)))
                    if event.event in FINAL:
                        return

        reader = threading.Thread(target=follow)
        reader.start()
        doc = wait_for(lambda: status(client, moving),
                       lambda d: d["progress"].get("semantic", {}).get("tokens", 0) >= 30, timeout=120)
        victim = doc["stages"]["semantic"]["replica"]
        pid = replica_pids(client)[victim]
        others = [submit(client, seed) for seed in range(2, 6)]
        os.kill(pid, signal.SIGKILL)
        degraded = wait_for(lambda: client.get("/health"), lambda r: r.json()["replicas"] == "1/2", timeout=30)
        assert degraded.status_code == 200 and degraded.json()["status"] == "ok"  # degraded, still serving
        doc = final(client, moving)
        assert doc["status"] == "complete", doc["error"]
        verify_result(tmp_path / "data" / "jobs" / moving)
        assert [r["kind"] for r in doc["retries"]] == ["replica"] and victim in doc["retries"][0]["reason"]
        assert doc["stages"]["plan"]["replica"] == victim  # the verified plan was kept, not redone
        assert doc["stages"]["semantic"]["replica"] != victim
        for job_id in others:
            assert final(client, job_id)["status"] == "complete"
        assert completed_total(client) == 1 + len(others)  # nothing ran twice to completion
        reader.join(timeout=60)
        ids = [int(event_id) for event_id, _, _ in events[1:]]
        kinds = [kind for _, kind, _ in events]
        assert kinds[0] == "status" and kinds[-1] == "complete" and kinds.count("complete") == 1, kinds
        assert ids == sorted(ids) and len(set(ids)) == len(ids)  # one ordered stream across the move
        retry = kinds.index("retry")
        assert "generating" in [data.get("status") for _, kind, data in events[retry:] if kind == "state"]
        assert all(data.get("replica") != victim for _, kind, data in events[retry:] if kind == "state")
        back = wait_for(lambda: client.get("/health"), lambda r: r.json()["replicas"] == "2/2", timeout=240)
        assert victim not in {r["replica"] for r in back.json()["replica_states"]}  # Serve started a new one
    finally:
        server.kill()


@pytest.mark.slow  # a cluster restart or a replica replaced: 40-140 s here; the two-song test is the default run's
def test_ingress_kill_9_then_restart_accounts_for_every_job(tmp_path):
    server = start(tmp_path)
    jobs = [submit(server.client, seed, **(LONGER if seed == 0 else {})) for seed in range(5)]
    wait_for(lambda: status(server.client, jobs[0]), lambda d: d["status"] == "generating", timeout=120)
    done_before = {job_id: doc["finished"] for job_id in jobs
                   if (doc := status(server.client, job_id))["status"] == "complete"}
    pids = list(replica_pids(server.client).values())
    server.kill()
    wait_for(lambda: [pid for pid in pids if alive(pid)], lambda left: not left, timeout=30)  # replicas died too
    server = start(tmp_path)
    try:
        for job_id in jobs:
            doc = final(server.client, job_id)
            assert doc["status"] == "complete", (job_id, doc["error"])
            verify_result(tmp_path / "data" / "jobs" / job_id)
            if job_id in done_before:
                assert doc["finished"] == done_before[job_id] and not doc["retries"]
        assert [r["kind"] for r in status(server.client, jobs[0])["retries"]] == ["restart"]
        listed = {song["id"] for song in server.client.get("/v1/songs").json()["songs"]}
        assert set(jobs) <= listed
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_a_replica_whose_engine_is_gone_for_good_is_replaced_and_its_song_moves(tmp_path):
    """vLLM engines in both replicas; one replica's engine killed until it may not restart (max_restarts 3): the
    song it was running completes elsewhere (a `replica` retry, not a failure) and Serve replaces the replica."""
    server = start(tmp_path, 2, "vllm", "--max-concurrency", "1")
    client = server.client
    try:
        states = client.get("/health").json()["replica_states"]
        victim, pid = states[0]["replica"], states[0]["pid"]
        def engine_state():
            return {r["replica"]: r["engine"] for r in client.get("/health").json()["replica_states"]}.get(victim)

        for _ in range(3):  # three restarts spend the engine's budget (3 per 10 minutes)
            os.killpg(engine_worker(pid), signal.SIGKILL)
            wait_for(engine_state, lambda state: state != "running", timeout=60)  # restarting ...
            wait_for(engine_state, lambda state: state == "running", timeout=300)  # ... and up again
        jobs = [submit(client, seed, semantic_sampling={"min_tokens": 1500, "max_tokens": 1500}) for seed in (1, 2)]
        on_victim = wait_for(lambda: [status(client, j) for j in jobs],
                             lambda docs: any(d["stages"]["semantic"].get("replica") == victim and
                                              d["progress"]["semantic"]["tokens"] >= 20 for d in docs), timeout=180)
        moving = next(d["id"] for d in on_victim if d["stages"]["semantic"].get("replica") == victim)
        os.killpg(engine_worker(pid), signal.SIGKILL)  # the fourth death: this engine is gone for good
        doc = final(client, moving, timeout=600)
        assert doc["status"] == "complete", doc["error"]
        assert [r["kind"] for r in doc["retries"]] == ["replica"] and victim in doc["retries"][0]["reason"]
        assert doc["stages"]["semantic"]["replica"] != victim
        assert all(final(client, j)["status"] == "complete" for j in jobs)
        back = wait_for(lambda: client.get("/health"), lambda r: r.json()["replicas"] == "2/2" and victim not in
                        {x["replica"] for x in r.json()["replica_states"]}, timeout=300)
        assert back.status_code == 200
    finally:
        server.kill()


@pytest.mark.slow  # a Ray cluster; the default run keeps its single-process sibling (tests/test_serve_durable.py)
def test_a_full_data_dir_under_replicas_loses_nothing_and_wedges_nothing(tmp_path):
    """--replicas 2 with the data dir on a real tmpfs that fills for ~8 s while songs run: /health says so (503),
    the songs writing then fail with DiskFull and resume, the queue drains without a restart, /health is ok after,
    and a restart reads every job back unchanged."""
    from serving import fill, tmpfs

    with tmpfs(tmp_path / "disk", size="64m") as mount:
        config = tmp_path / "generation.json"
        config.write_text(json.dumps(GENERATION), encoding="utf-8")
        args = ["--data-dir", str(mount / "data"), "--config", str(config), "--replicas", "2", "--backend", "torch",
                "--min-free-disk", "0.001"]
        server = ProcessServer(args, log=tmp_path / "serve.log")
        client = server.client
        try:
            wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=180)
            jobs = [submit(client, seed, **LONGER) for seed in range(4)]
            wait_for(lambda: status(client, jobs[0]), lambda d: d["status"] == "generating", timeout=120)
            ballast = fill(mount)
            try:
                down = wait_for(lambda: client.get("/health"), lambda r: r.status_code == 503, timeout=30).json()
                assert any("the data dir" in p and "bytes free" in p for p in down["problems"]), down
                assert client.post("/v1/songs", json=SONG).status_code == 507
                time.sleep(8)
            finally:
                ballast.unlink()
            wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=60)
            documents = {job: final(client, job) for job in jobs}
            for job, doc in documents.items():
                if doc["status"] == "failed":
                    assert doc["error"]["type"] == "DiskFull", doc["error"]
                    assert client.post(f"/v1/songs/{job}/resume").status_code == 202
                    documents[job] = final(client, job)
                assert documents[job]["status"] == "complete", documents[job]["error"]
                verify_result(mount / "data" / "jobs" / job)
        finally:
            server.stop()
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
        server = ProcessServer(args, log=tmp_path / "serve.log")
        try:
            for job in jobs:
                assert status(server.client, job)["finished"] == documents[job]["finished"]
        finally:
            server.stop()
