"""A full disk under the serving core: every job's transition lands, /health tells the truth while it lasts and
after, the queue drains without a restart, a restart reads every job back unchanged, every finished song verifies.
The disk is a real full filesystem (a tmpfs, when this runs as root) and, everywhere, injected faults at every write
site (ENOSPC for the songs' files, "database or disk is full" for the job store), raised for a while and lifted."""
import errno
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from serving import ThreadServer, fill, pipe, tmpfs, wait_for  # noqa: F401 (pipe: a fixture)
from yue2_vllm.artifacts import verify_result
from yue2_vllm.serve import durable
from yue2_vllm.serve.durable import DurableStore, probe_writable
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.serve.store import JobStore, NewJob

FINAL = ("complete", "failed", "cancelled")
SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
STORE_WRITES = ("update", "requeue", "mark_deleted", "delete", "admit")


class InjectedDisk:
    """While `full`: every job-store write raises "database or disk is full", every artifact write ENOSPC (at its
    fsync, after the bytes went to the temp file) and the data dir's probe write is refused."""

    def __init__(self, monkeypatch):
        self.full = False
        self.store_failures = self.file_failures = 0
        for name in STORE_WRITES:
            monkeypatch.setattr(JobStore, name, self._store_write(getattr(JobStore, name)))
        real_fsync = os.fsync

        def fsync(descriptor):
            if self.full:
                self.file_failures += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_fsync(descriptor)

        monkeypatch.setattr(os, "fsync", fsync)
        real_probe = durable.probe_writable
        monkeypatch.setattr(durable, "probe_writable",
                            lambda d: "No space left on device" if self.full else real_probe(d))

    def _store_write(self, method):
        def write(store, *args, **kwargs):
            if self.full:
                self.store_failures += 1
                raise sqlite3.OperationalError("database or disk is full")
            return method(store, *args, **kwargs)
        return write


def health(client):
    response = client.get("/health")
    return response.status_code, response.json()


def run_through_a_full_disk(pipe, data_dir: Path, make_full, make_free, songs: int = 6):
    """`songs` songs at concurrency 2; the disk is full from the moment the first song runs for ~3 s. Every job
    ends complete (the ones failed for want of space say so and are resumed to complete), /health reports the
    fault during it and ok after, a restart on the data dir reads every job back unchanged, every song verifies."""
    # The retention sweep every 0.5 s: the watchdog calls the owner while it waits on the store, as it does in a
    # long-lived server's full-disk window.
    config = ServeConfig(data_dir, concurrency=2, stall_seconds=60, min_free_bytes=1 << 20, watchdog_interval=0.2,
                         sweep_interval=0.5)
    service = SongService(pipe, config)
    server = ThreadServer(service)
    client = server.client
    seen_problems: list[str] = []
    try:
        jobs = []
        for seed in range(songs):
            response = client.post("/v1/songs", json={**SONG, "seed": seed})
            assert response.status_code == 202, response.text
            jobs.append(response.json()["id"])
        wait_for(lambda: client.get(f"/v1/songs/{jobs[0]}").json(), lambda d: d["status"] != "queued", timeout=60)
        make_full()
        try:
            down = wait_for(lambda: health(client), lambda h: h[0] == 503, timeout=30)
            seen_problems += down[1]["problems"]
            assert down[1]["status"] == "unavailable" and down[1]["disk"]["data_dir"].endswith(data_dir.name)
            refused = client.post("/v1/songs", json=SONG)
            assert refused.status_code in (503, 507), refused.text
            for job_id in jobs:  # every read answers during the window
                assert client.get(f"/v1/songs/{job_id}").status_code == 200
            time.sleep(3)
            seen_problems += health(client)[1]["problems"]
        finally:
            make_free()
        wait_for(lambda: health(client), lambda h: h[0] == 200, timeout=60)
        documents = {job_id: wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                                      lambda d: d["status"] in FINAL, timeout=120) for job_id in jobs}
        failed = [job_id for job_id, doc in documents.items() if doc["status"] != "complete"]
        for job_id in failed:
            error = documents[job_id]["error"]
            assert documents[job_id]["status"] == "failed" and error["type"] == "DiskFull", error
            assert f"the data dir …/{data_dir.name} has " in error["message"] and "resume" in error["message"], error
            assert client.post(f"/v1/songs/{job_id}/resume").status_code == 202
        for job_id in failed:
            documents[job_id] = wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                                         lambda d: d["status"] in FINAL, timeout=120)
            assert documents[job_id]["status"] == "complete", documents[job_id]["error"]
        assert health(client) == (200, health(client)[1]) and health(client)[1]["queue"]["depth"] == 0
        assert not list(data_dir.rglob("*.tmp")), "temp files were left behind"
    finally:
        server.stop()
    assert any(f"the data dir …/{data_dir.name} " in p and "bytes free" in p for p in seen_problems), seen_problems
    reopened = SongService(pipe, ServeConfig(data_dir))
    try:
        for job_id in jobs:
            again = reopened.document(job_id)
            assert again["status"] == "complete"
            assert {k: again[k] for k in ("status", "result", "stages", "attempts", "finished")} == \
                {k: documents[job_id][k] for k in ("status", "result", "stages", "attempts", "finished")}
            verify_result(data_dir / "jobs" / job_id)
    finally:
        reopened.store.close()
    print(f"\n{len(failed)} of {len(jobs)} failed for want of space and were resumed; problems seen: {seen_problems}")
    return failed, seen_problems


def test_injected_store_and_file_faults_lose_no_transition_and_wedge_nothing(pipe, tmp_path, monkeypatch, caplog):
    disk = InjectedDisk(monkeypatch)
    caplog.set_level(logging.WARNING, "yue2_vllm")
    failed, problems = run_through_a_full_disk(pipe, tmp_path / "data", lambda: setattr(disk, "full", True),
                                               lambda: setattr(disk, "full", False))
    assert disk.store_failures > 0 and disk.file_failures > 0
    assert any("job store" in p and "cannot be written" in p for p in problems), problems
    assert not [r for r in caplog.records if r.exc_info], "an expected fault logged a traceback"
    assert "Traceback" not in caplog.text, caplog.text
    # The watchdog met the waiting store (its sweep answered 503) and said so in one line.
    assert "watchdog: _sweep failed: Unavailable: the job store" in caplog.text, caplog.text


def test_a_real_full_filesystem_loses_no_transition_and_wedges_nothing(pipe, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "yue2_vllm")
    with tmpfs(tmp_path / "disk") as mount:
        data_dir = mount / "data"
        ballast: list[Path] = []
        failed, problems = run_through_a_full_disk(pipe, data_dir, lambda: ballast.append(fill(mount)),
                                                   lambda: ballast.pop().unlink())
        assert any("cannot be written" in p or "under --min-free-disk" in p for p in problems), problems
    assert "Traceback" not in caplog.text, "an expected condition of a full disk logged a traceback:\n" + caplog.text


def test_health_reports_work_pending_that_does_not_move(pipe, tmp_path):
    """Queued jobs none of which starts, and jobs the store says run with no run behind them: each a /health
    problem after stall_seconds, gone by itself once things move."""
    service = SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1, stall_seconds=1))
    server = ThreadServer(service)
    client = server.client
    try:
        service.workers.scheduler.start_gate = lambda handle: "held by this test"
        job = client.post("/v1/songs", json=SONG).json()["id"]
        stuck = wait_for(lambda: health(client), lambda h: h[0] == 503, timeout=30)[1]
        assert stuck["problems"] == ["1 job(s) are queued and none has started for 1 s (0 of 1 in flight)"]
        service.workers.scheduler.start_gate = None
        assert wait_for(lambda: client.get(f"/v1/songs/{job}").json(), lambda d: d["status"] in FINAL,
                        timeout=60)["status"] == "complete"
        assert health(client)[0] == 200
        service.store.update(job, status="generating")  # as the lost transitions left it
        lost = wait_for(lambda: health(client), lambda h: h[0] == 503, timeout=30)[1]
        assert lost["problems"] == ["1 job(s) the store says are running have no run behind them"]
        service.store.update(job, status="complete")
        assert health(client)[0] == 200
    finally:
        server.stop()


def test_while_the_owner_waits_on_the_store_calls_answer_503_at_once_and_land_after(pipe, tmp_path, monkeypatch):
    disk = InjectedDisk(monkeypatch)
    service = SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1, min_free_bytes=0))
    server = ThreadServer(service)
    client = server.client
    try:
        long = {**SONG, "semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}
        job = client.post("/v1/songs", json=long).json()["id"]
        wait_for(lambda: client.get(f"/v1/songs/{job}").json(), lambda d: d["status"] == "generating", timeout=60)
        disk.full = True
        service._call(lambda: None)  # the owner is idle; the next write it makes blocks it
        cancel = client.post(f"/v1/songs/{job}/cancel")  # cancel_requested=1 cannot be written
        assert cancel.status_code == 503 and "job store cannot be written" in cancel.json()["error"]["message"]
        assert health(client)[1]["disk"]["store_writable"] is False
        disk.full = False
        assert wait_for(lambda: client.get(f"/v1/songs/{job}").json(), lambda d: d["status"] in FINAL,
                        timeout=60)["status"] == "cancelled"  # the cancel landed once the store took writes
        assert wait_for(lambda: health(client), lambda h: h[0] == 200, timeout=30)[1]["disk"]["store_writable"]
    finally:
        server.stop()


def test_a_server_stops_while_the_store_cannot_be_written_and_the_next_start_resumes_its_jobs(pipe, tmp_path,
                                                                                           monkeypatch):
    disk = InjectedDisk(monkeypatch)
    config = ServeConfig(tmp_path / "data", concurrency=1, min_free_bytes=0, shutdown_seconds=5)
    service = SongService(pipe, config)
    service.start()
    long = {**SONG, "semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}
    record, _ = service.submit(json.dumps(long).encode())
    wait_for(lambda: service.store.get(record.id).status, lambda s: s == "generating", timeout=60)
    disk.full = True
    started = time.monotonic()
    service.close()  # gives up on the writes it cannot make, in one line each
    assert time.monotonic() - started < 30
    disk.full = False
    again = SongService(pipe, config)
    again.start()
    try:  # it was generating when the server stopped: resumed as a restart (the shutdown requeue did not land)
        resumed = again.store.get(record.id)
        assert resumed.status != "failed" and resumed.retries[-1]["kind"] == "restart" and resumed.attempts == 2
    finally:
        again.close()


# -- the store and the file writes on their own


def test_a_store_write_is_retried_until_it_lands_and_says_what_waits(tmp_path, monkeypatch):
    disk = InjectedDisk(monkeypatch)
    store = DurableStore(JobStore(tmp_path / "jobs.sqlite3"), tmp_path)
    store.admit(NewJob("j1", None, "audio", {}, {}, "0" * 64), None)
    disk.full = True
    landed = threading.Event()
    thread = threading.Thread(target=lambda: (store.update("j1", status="planning"), landed.set()))
    thread.start()
    fault = wait_for(store.fault, lambda f: f is not None and f.attempts >= 3, timeout=10)
    assert fault.what == "update of job j1" and "disk is full" in fault.error and not landed.is_set()
    assert store.get("j1").status == "queued"  # reads answer meanwhile
    disk.full = False
    assert landed.wait(10) and store.fault() is None and store.get("j1").status == "planning"
    thread.join()
    store.close()


def test_a_store_write_gives_up_only_while_stopping(tmp_path, monkeypatch):
    disk = InjectedDisk(monkeypatch)
    stopping = threading.Event()
    store = DurableStore(JobStore(tmp_path / "jobs.sqlite3"), tmp_path, stopping=stopping.is_set)
    store.admit(NewJob("j1", None, "audio", {}, {}, "0" * 64), None)
    disk.full = True
    stopping.set()
    store.wake()
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        store.update("j1", status="planning")
    store.close()


def test_the_store_recovers_from_a_commit_on_a_real_full_filesystem(tmp_path):
    """SQLITE_FULL (at a statement or at COMMIT) leaves no transaction open: the next write, once space is back,
    lands (no "cannot start a transaction within a transaction")."""
    with tmpfs(tmp_path / "disk", size="4m") as mount:
        store = JobStore(mount / "jobs.sqlite3")
        store.admit(NewJob("j1", None, "audio", {}, {}, "0" * 64), None)
        ballast = fill(mount)
        with pytest.raises(sqlite3.OperationalError):
            for _ in range(1000):  # until the WAL can grow no more
                store.update("j1", stages={"plan": {"state": "done", "pad": "x" * 60000}})
        assert store.get("j1") is not None
        ballast.unlink()
        assert store.update("j1", status="planning") and store.get("j1").status == "planning"
        store.close()


def test_the_probe_write_sees_a_full_filesystem_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "disk", size="1m") as mount:
        assert probe_writable(mount) is None
        ballast = fill(mount)
        assert probe_writable(mount) == os.strerror(errno.ENOSPC)
        ballast.unlink()
        assert probe_writable(mount) is None and list(mount.iterdir()) == []


def test_durable_retries_only_what_another_attempt_may_pass():
    assert durable.store_fault_error(sqlite3.OperationalError("database is locked"))
    assert not durable.store_fault_error(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not durable.store_fault_error(LookupError("j1"))
