"""Takes over HTTP on real uvicorn servers: a job with takes lists them (status, seed, signals, links), serves each
take's files, keeps one, deletes one, cancels, resumes and restarts take by take; bad take fields are 422s."""
import json
import time

import numpy as np
import pytest

from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.serve.store import JobStore, NewJob

from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)

SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
LONG = {"semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}
FINAL = ("complete", "failed", "cancelled")


@pytest.fixture
def serve(pipe, tmp_path):
    servers = []

    def start(**options):
        options.setdefault("data_dir", tmp_path / "data")
        server = ThreadServer(SongService(pipe, ServeConfig(**options)))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def post(client, expect=202, **body) -> dict:
    response = client.post("/v1/songs", json={**SONG, **body})
    assert response.status_code == expect, response.text
    return response.json()


def final(client, path, timeout=180) -> dict:
    return wait_for(lambda: client.get(path).json(), lambda d: d["status"] in FINAL, timeout)


def all_final(client, job_id, timeout=180) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                    lambda d: all(e["status"] in FINAL + ("deleted",) for e in d["takes"]["entries"]), timeout)


def test_a_job_with_takes_lists_them_and_serves_each_takes_files(serve, tmp_path):
    server = serve()
    client = server.client
    job = post(client, takes=3, best_of=True)
    doc = all_final(client, job["id"])
    takes = doc["takes"]
    assert (takes["of"], takes["complete"], takes["not_complete"]) == (3, [1, 2, 3], [])
    entries = takes["entries"]
    assert [e["seed"] for e in entries] == [7, 8, 9] and entries[0]["id"] == job["id"]
    for entry in entries:
        assert entry["status"] == "complete" and entry["signals"]["semantic_mean_logprob"] < 0
        assert entry["urls"]["audio"] == f"/v1/songs/{job['id']}/takes/{entry['take']}/audio"
    best = max(entries, key=lambda e: (e["signals"]["semantic_mean_logprob"], -e["take"]))
    assert takes["pick"] == best["take"] and takes["best_of"] is True and takes["kept"] is None
    jobs = tmp_path / "data" / "jobs"
    for entry in entries:
        audio = client.get(entry["urls"]["audio"])
        assert audio.status_code == 200 and audio.content == (jobs / entry["id"] / "audio.flac").read_bytes()
        assert client.get(entry["urls"]["score"]).content == (jobs / entry["id"] / "score.abc").read_bytes()
        assert client.get(entry["urls"]["result"]).json()["identity"]
    assert client.get(f"/v1/songs/{job['id']}/audio").content == client.get(entries[0]["urls"]["audio"]).content
    take2 = client.get(f"/v1/songs/{job['id']}/takes/2").json()
    assert take2["id"] == entries[1]["id"] and take2["takes"] == {"take": 2, "of": 3, "job": job["id"]}
    assert take2["request"]["seed"] == 8 and "takes" not in take2["sampling"]
    # take k is the one-take song of its seed
    one = post(client, seed=8)
    assert final(client, f"/v1/songs/{one['id']}")["status"] == "complete"
    for name in ("abc_tokens.npy", "semantic.npy"):
        assert np.array_equal(np.load(jobs / one["id"] / name), np.load(jobs / entries[1]["id"] / name))
    # the list shows the job once (its takes are in its listing)
    listed = [song["id"] for song in client.get("/v1/songs").json()["songs"]]
    assert listed == [one["id"], job["id"]]
    assert client.get("/v1/songs").json()["songs"][1]["takes"] == 3
    # keep one, delete another: recorded on the job
    kept = client.post(f"/v1/songs/{job['id']}/takes/2/keep")
    assert kept.status_code == 200 and kept.json()["takes"]["kept"] == 2
    assert client.delete(f"/v1/songs/{job['id']}/takes/1").status_code == 409
    assert client.delete(f"/v1/songs/{job['id']}/takes/3").status_code == 204
    assert not (jobs / entries[2]["id"]).exists()
    assert client.get(f"/v1/songs/{job['id']}/takes/3/audio").status_code == 404
    assert client.get(f"/v1/songs/{job['id']}/takes/4").status_code == 404
    doc = client.get(f"/v1/songs/{job['id']}").json()
    assert [e["status"] for e in doc["takes"]["entries"]] == ["complete", "complete", "deleted"]
    assert doc["takes"]["kept"] == 2
    # deleting the job removes every take
    assert client.delete(f"/v1/songs/{job['id']}").status_code == 204
    assert not (jobs / job["id"]).exists() and not (jobs / entries[1]["id"]).exists()
    assert client.get(f"/v1/songs/{entries[1]['id']}").status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"takes": 9}, "takes"), ({"takes": 0}, "takes"), ({"takes": "2"}, "takes"),
    ({"best_of": True}, "best_of"), ({"takes_share_score": True}, "takes_share_score"),
    ({"takes": 2, "cot": "off", "stage": "plan"}, "takes"),
    ({"takes": 2, "cot": "melody", "abc": "X:1\nCDE|", "stage": "plan"}, "takes"),
    ({"takes": 3}, "takes"),  # over this server's --max-takes 2
])
def test_bad_take_fields_are_422_naming_the_field(serve, body, field):
    client = serve(max_takes=2).client
    response = client.post("/v1/songs", json={**SONG, **body})
    assert response.status_code == 422 and response.json()["error"]["field"] == field, response.text
    assert client.get("/v1/songs").json()["songs"] == []


def test_takes_cancel_and_resume_one_by_one_and_the_queue_counts_every_take(serve):
    server = serve(concurrency=1, queue_size=3)
    client = server.client
    assert post(client, 429, takes=4)["error"]["message"].startswith("the queue is full")
    job = post(client, takes=3, **LONG)
    doc = wait_for(lambda: client.get(f"/v1/songs/{job['id']}").json(),
                   lambda d: d["status"] == "generating" and d["takes"]["entries"][1]["status"] == "queued")
    third = doc["takes"]["entries"][2]["id"]
    assert client.post(f"/v1/songs/{third}/cancel").json()["status"] == "cancelled"  # one take, on its own
    assert client.post(f"/v1/songs/{job['id']}/cancel").status_code == 202  # the job: every take of it
    doc = all_final(client, job["id"])
    assert [e["status"] for e in doc["takes"]["entries"]] == ["cancelled"] * 3
    assert client.post(f"/v1/songs/{job['id']}/resume").status_code == 202
    doc = wait_for(lambda: client.get(f"/v1/songs/{job['id']}").json(),
                   lambda d: d["takes"]["entries"][0]["status"] == "generating")
    assert [e["status"] for e in doc["takes"]["entries"]][1:] == ["queued", "queued"]
    assert client.post(f"/v1/songs/{job['id']}/cancel").status_code == 202
    all_final(client, job["id"])


def test_a_take_that_is_stopped_leaves_its_siblings_and_resume_redoes_only_it(serve):
    client = serve(concurrency=1).client
    job = post(client, takes=2)
    take2 = client.get(f"/v1/songs/{job['id']}").json()["takes"]["entries"][1]["id"]
    client.post(f"/v1/songs/{take2}/cancel")
    doc = all_final(client, job["id"])
    assert doc["takes"]["complete"] == [1] and doc["takes"]["not_complete"] == [2]
    assert client.post(f"/v1/songs/{job['id']}/resume").status_code == 202
    doc = all_final(client, job["id"])
    assert doc["takes"]["complete"] == [1, 2] and doc["attempts"] == 1  # take 1 was not run again


def test_takes_share_one_planned_score(serve, tmp_path):
    client = serve().client
    job = post(client, takes=2, takes_share_score=True)
    doc = all_final(client, job["id"])
    entries = doc["takes"]["entries"]
    assert doc["takes"]["share_score"] is True and [e["status"] for e in entries] == ["complete", "complete"]
    jobs = tmp_path / "data" / "jobs"
    score = (jobs / job["id"] / "score.abc").read_text()
    take2 = client.get(f"/v1/songs/{job['id']}/takes/2").json()
    assert take2["request"]["abc"] == score and take2["request"]["seed"] == 8
    assert (jobs / entries[1]["id"] / "score.abc").read_text() == score


def test_a_restart_mid_takes_continues_the_unfinished_takes_only(pipe, tmp_path):
    (tmp_path / "data").mkdir()
    store = JobStore(tmp_path / "data" / "jobs.sqlite3")  # what a crashed server left behind
    request = {"style": "pop", "lyrics": "la", "cot": "full", "seed": 3, "abc": None, "cfg_scale": None}
    stages = {s: {"state": "pending"} for s in ("plan", "semantic", "synthesis", "audio")}
    ids = [f"j{n:020x}" for n in (1, 2, 3)]
    parent = {"takes": {"take": 1, "of": 3, "best_of": False, "share_score": False, "children": ids[1:], "kept": None}}
    for k, (job_id, status) in enumerate(zip(ids, ("complete", "generating", "queued")), 1):
        overrides = parent if k == 1 else {"takes": {"take": k, "of": 3, "parent": ids[0], "share_score": False}}
        store.admit(NewJob(job_id, None, "audio", {**request, "id": job_id, "seed": 2 + k}, overrides, "b", None,
                           stages), None)
        store.update(job_id, status=status)
    store.close()
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data")))
    try:
        doc = all_final(server.client, ids[0])
        take2 = server.client.get(f"/v1/songs/{ids[0]}/takes/2").json()
    finally:
        server.stop()
    assert [e["status"] for e in doc["takes"]["entries"]] == ["complete"] * 3
    assert doc["attempts"] == 0 and not (tmp_path / "data" / "jobs" / ids[0]).exists()  # take 1 was done: not rerun
    assert take2["retries"][0]["reason"] == "server restarted while generating"
    assert json.loads((tmp_path / "data" / "jobs" / ids[2] / "request.json").read_text())["seed"] == 5


def test_an_idempotent_repeat_is_the_same_job_and_retention_purges_every_take(serve, tmp_path):
    server = serve(retention_seconds=0.5)
    client = server.client
    headers = {"Idempotency-Key": "takes-key-1"}
    first = client.post("/v1/songs", json={**SONG, "takes": 2}, headers=headers)
    again = client.post("/v1/songs", json={**SONG, "takes": 2}, headers=headers)
    assert (first.status_code, again.status_code) == (202, 200) and first.json()["id"] == again.json()["id"]
    doc = all_final(client, first.json()["id"])
    assert len(doc["takes"]["entries"]) == 2
    jobs = tmp_path / "data" / "jobs"
    assert len(list(jobs.iterdir())) == 2
    time.sleep(0.6)
    server.service._call(server.service._sweep)  # what the watchdog runs once a minute
    assert sorted(p.name for p in jobs.iterdir()) == []
    assert client.get(f"/v1/songs/{first.json()['id']}").status_code == 404
