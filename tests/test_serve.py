"""`yue2-vllm serve` against real uvicorn servers on loopback: every status code of the contract, SSE order,
Range requests, idempotency, auth, cancel and delete, id validation, restarts after kill -9, and the vLLM engine."""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import soundfile

from yue2_vllm.artifacts import verify_result
from yue2_vllm.cli import main
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.serve.app import OpenFileResponse, redact
from yue2_vllm.serve.runner import data_dir_lock
from yue2_vllm.serve.errors import RequestInvalid
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.serve.submission import JOB_ID, parse_submission
from yue2_vllm.serve.store import JobStore, NewJob
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AROptions, EngineOptions

from serving import GENERATION, ProcessServer, ThreadServer, pipe, read_events, wait_for  # noqa: F401 (pipe)

SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
LONG = {"semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}  # runs until it is cancelled
FINAL = ("complete", "failed", "cancelled")
AS_JSON = {"Content-Type": "application/json"}
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")


@pytest.fixture
def serve(pipe, tmp_path):
    """`serve(**ServeConfig fields, api_key=...)` → a running ThreadServer on a fresh data dir."""
    servers = []

    def start(api_key=None, **options):
        options.setdefault("data_dir", tmp_path / "data")
        server = ThreadServer(SongService(pipe, ServeConfig(**options)), api_key=api_key)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def submit(client, expect=202, headers=None, **body) -> dict:
    response = client.post("/v1/songs", json={**SONG, **body}, headers=headers)
    assert response.status_code == expect, response.text
    return response.json()


def final(client, job_id, timeout=180) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(), lambda d: d["status"] in FINAL, timeout)


def stage_records(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.glob("*.stage.json")}


def error_of(response) -> dict:
    return response.json()["error"]


def cancel(client, job: dict):
    return client.post(f"{job['urls']['self']}/cancel")


# --------------------------------------------------------------------------- a song, its files, Range


def test_a_song_from_post_to_download(serve, tmp_path):
    server = serve()
    client = server.client
    response = client.post("/v1/songs", json={**SONG, "id": "my-song"})
    assert response.status_code == 202
    job = response.json()
    assert JOB_ID.fullmatch(job["id"]) and job["label"] == "my-song" and job["status"] == "queued"
    assert response.headers["location"] == job["urls"]["self"] == f"/v1/songs/{job['id']}"
    assert set(job["urls"]) == {"self", "events", "audio", "score", "result"}
    doc = final(client, job["id"])
    assert doc["status"] == "complete" and doc["error"] is None and doc["attempts"] == 1
    assert doc["request"] == {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7, "cot": "full",
                              "abc": None, "cfg_scale": None}
    assert doc["progress"]["abc"] == {"tokens": 6, "max_tokens": 6}
    assert doc["progress"]["semantic"] == {"tokens": 12, "max_tokens": 12}
    for stage in ("plan", "semantic"):
        entry = doc["stages"][stage]
        assert entry["state"] == "done" and entry["backend_actual"] == "torch" and entry["fallback_reason"] is None
        assert entry["seconds"] > 0 and entry["started"] <= entry["finished"]
    assert doc["stages"]["synthesis"]["seconds"] > 0 and doc["stages"]["audio"]["samples"] == 12 * 1920 - 64
    directory = tmp_path / "data" / "jobs" / job["id"]
    document = verify_result(directory)
    assert doc["result"]["identity"] == document["identity"]
    assert not list((tmp_path / "data").rglob("my-song*"))  # the label is never a path

    flac = (directory / "audio.flac").read_bytes()
    audio = client.get(job["urls"]["audio"])
    assert audio.status_code == 200 and audio.headers["content-type"] == "audio/flac"
    assert audio.content == flac and audio.headers["accept-ranges"] == "bytes"
    assert 'filename="my-song.flac"' in audio.headers["content-disposition"]
    for header, piece in (("bytes=100-199", flac[100:200]), ("bytes=-50", flac[-50:]), ("bytes=1000-", flac[1000:])):
        part = client.get(job["urls"]["audio"], headers={"Range": header})
        assert part.status_code == 206 and part.content == piece, header
        start = len(flac) - len(piece) if header.startswith("bytes=-") or header.endswith("-") else 100
        assert part.headers["content-range"] == f"bytes {start}-{start + len(piece) - 1}/{len(flac)}"
    assert client.get(job["urls"]["audio"], headers={"Range": f"bytes={len(flac)}-"}).status_code == 416
    head = client.head(job["urls"]["audio"])
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(flac) and head.content == b""
    samples, rate = soundfile.read(directory / "audio.flac")
    assert rate == 48000 and samples.shape == (12 * 1920 - 64, 2)
    assert abs(doc["result"]["audio_seconds"] - len(samples) / rate) < 1e-6

    score = client.get(job["urls"]["score"])
    assert score.status_code == 200 and score.content == (directory / "score.abc").read_bytes()
    result = client.get(job["urls"]["result"])  # without a key: the file, with no server path in it
    assert result.json() == redact(json.loads((directory / "result.json").read_text()))
    assert result.json()["identity"] == document["identity"] and str(tmp_path) not in result.text

    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = [line for line in metrics.text.splitlines() if not line.startswith("#")]
    assert all(re.fullmatch(r'[a-z_][a-z0-9_]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eEInfa]+', line)
               for line in lines), lines
    values = {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)}
    assert values['yue2_songs_finished_total{status="complete"}'] == 1
    assert values['yue2_ar_tokens_total{phase="abc"}'] == 6 and values['yue2_ar_tokens_total{phase="semantic"}'] == 12
    assert values["yue2_nar_seconds_count"] == 1 and values["yue2_vae_seconds_count"] == 1
    assert values['yue2_nar_seconds_bucket{le="+Inf"}'] == 1 and values["yue2_nar_seconds_sum"] > 0
    assert values["yue2_queue_depth"] == 0 and values["yue2_songs_in_flight"] == 0
    assert values['yue2_jobs{status="complete"}'] == 1 and values["yue2_engine_restarts_total"] == 0
    assert values['yue2_http_responses_total{code="202"}'] == 1
    assert values["process_resident_memory_bytes"] > 0  # prometheus_client's process collector
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["engine"] == {"backend_requested": "torch",
                                                                     "backend": "torch", "state": "none"}
    assert health.json()["queue"] == {"depth": 0, "limit": 64, "held": 0} and health.json()["problems"] == []


def test_events_come_in_order_after_a_snapshot(serve):
    server = serve(concurrency=1)
    client = server.client
    first = submit(client)
    job = submit(client, semantic_sampling={"min_tokens": 40, "max_tokens": 40})  # queued behind the first
    events = read_events(client, job["id"])
    kinds = [kind for kind, _, _ in events]
    assert kinds[0] == "status" and events[0][1]["status"] == "queued" and events[0][1]["id"] == job["id"]
    assert kinds[-1] == "complete" and events[-1][1]["result"]["audio_seconds"] > 0
    assert [d["status"] for k, d, _ in events if k == "state"] == ["planning", "generating", "synthesizing",
                                                                 "decoding"]
    assert [d["stage"] for k, d, _ in events if k == "stage"] == ["plan", "semantic", "synthesis", "audio"]

    def at(kind, **match):
        return next(i for i, (k, d, _) in enumerate(events) if k == kind and all(d.get(n) == v for n, v in match.items()))

    assert at("state", status="planning") < at("stage", stage="plan") < at("score") < at("state", status="generating")
    assert events[at("score")][1]["abc"] == client.get(job["urls"]["score"]).text
    tokens = [(d["phase"], d["count"], t) for k, d, t in events if k == "tokens"]
    assert all(at("state", status="planning") < i < at("stage", stage="plan")
               for i, (k, d, _) in enumerate(events) if k == "tokens" and d["phase"] == "abc")
    semantic = [count for phase, count, _ in tokens if phase == "semantic"]
    assert semantic == sorted(semantic) and len(semantic) < 40  # throttled: not one event per token
    span = tokens[-1][2] - tokens[0][2]
    assert len(tokens) <= 4 * span + 2, (len(tokens), span)  # at most 4 token events a second (plus slack)
    nar = [d for k, d, _ in events if k == "nar"]
    assert nar[-1] == {"done": 2, "total": 2}
    assert at("state", status="synthesizing") < at("nar") < at("stage", stage="synthesis") < at("vae")
    assert at("state", status="decoding") < at("vae") < at("stage", stage="audio") < at("complete")

    late = read_events(client, job["id"])  # a client that connects once it is done: the state, then the end
    assert [k for k, _, _ in late] == ["status", "complete"] and late[0][1]["status"] == "complete"
    assert final(client, first["id"])["status"] == "complete"


def test_songs_past_one_nar_chunk_through_the_server_report_one_nar_total(tiny_model_dir, tiny_vae_dir, tmp_path):
    """A 98-token NAR context behind ~79-token prefixes: 12 frames in two chunks: 2 steps x 2 chunk-steps."""
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config={**GENERATION, "context": 98}) as chunked:
        server = ThreadServer(SongService(chunked, ServeConfig(tmp_path / "data", concurrency=1)))
        try:
            first = submit(server.client, seed=1)
            job = submit(server.client, seed=2)  # queued behind the first: its events stream from the start
            nar = [d for k, d, _ in read_events(server.client, job["id"]) if k == "nar"]
            assert nar and nar[-1] == {"done": 4, "total": 4} and {d["total"] for d in nar} == {4}
            for job in (first, job):
                doc = final(server.client, job["id"])
                assert doc["status"] == "complete" and doc["stages"]["audio"]["samples"] == 12 * 1920 - 64
        finally:
            server.stop()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("body, field, words", [
    ({"cfg_scale": 99}, "cfg_scale", "cfg_scale must be a finite number in [0, 20], got 99"),
    ({"seed": -1}, "seed", "seed"),
    ({"seed": 1.5}, "seed", "seed"),
    ({"cot": "half"}, "cot", "cot must be one of"),
    ({"tempo": 120}, "tempo", "unknown field(s) ['tempo']"),
    ({"style": None}, "style", "missing"),
    ({"lyrics": "  "}, "lyrics", "lyrics must be non-blank text"),
    ({"abc_path": "/etc/passwd"}, "abc_path", "abc_path is not accepted here"),
    ({"stage": "mix"}, "stage", "stage: must be 'plan' or 'audio'"),
    ({"reproducible": "yes"}, "reproducible", "reproducible: must be true or false"),
    ({"reproducible": True}, "reproducible", "start the server with --reproducible"),  # this server's engine is bf16
    ({"abc_sampling": {"top_p": 5}}, "abc_sampling", "top_p"),
    ({"semantic_sampling": {"tempo": 1}}, "semantic_sampling", "unknown field(s) ['tempo']"),
    ({"semantic_sampling": {"min_tokens": 9, "max_tokens": 3}}, "semantic_sampling", "min_tokens"),
    ({"id": "../x"}, "id", "id: must match"),
    ({"tags": "rock"}, "tags", "'tags' and 'style' differ"),
    ({"lyrics": "la " * 40000}, "lyrics", "the request is too long"),  # the context-budget check
])
def test_invalid_bodies_are_422_naming_the_field(serve, tmp_path, body, field, words):
    server = serve()
    payload = {k: v for k, v in {**SONG, **body}.items() if v is not None}
    response = server.client.post("/v1/songs", json=payload)
    assert response.status_code == 422, response.text
    assert error_of(response)["field"] == field and words in error_of(response)["message"]
    assert server.client.get("/v1/songs").json()["songs"] == []
    assert list((tmp_path / "data" / "jobs").iterdir()) == []


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

TEXT = st.one_of(st.text(max_size=10), st.sampled_from(["", " ", "\ud800", "../x", "/etc/passwd", "pop", "X:1\r\nK:C"]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=10)
BODIES = st.one_of(JSON, st.fixed_dictionaries({}, optional={
    name: JSON for name in ("style", "tags", "lyrics", "cot", "seed", "abc", "cfg_scale", "id", "abc_sampling",
                            "semantic_sampling", "stage", "prompt", "abc_path", "lang")}),
    st.fixed_dictionaries({"style": TEXT, "lyrics": TEXT}, optional={"cot": st.sampled_from(["full", "off", 1]),
                                                                      "seed": SCALARS, "stage": TEXT, "prompt": TEXT,
                                                                      "cfg_scale": SCALARS, "id": TEXT}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_any_json_body_is_a_song_or_a_422_naming_what_is_wrong(pipe, body):
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    try:
        song = parse_submission(pipe, raw, "j" + "0" * 20)
    except RequestInvalid as exc:
        assert exc.message and exc.status == 422
    else:
        assert song.request.id == "j" + "0" * 20 and song.stage in ("plan", "audio")


@pytest.mark.parametrize("raw, words", [(b"[1, 2]", "must be a JSON object"), (b"{not json", "invalid JSON"),
                                        (b"\xff\xfe", "not UTF-8"), (b"", "invalid JSON")])
def test_bodies_that_are_not_json_objects_are_422(serve, raw, words):
    response = serve().client.post("/v1/songs", content=raw, headers=AS_JSON)
    assert response.status_code == 422 and words in error_of(response)["message"]


def test_a_body_over_256_kib_is_413_declared_or_streamed(serve):
    client = serve().client
    big = json.dumps({**SONG, "lyrics": "x" * (256 * 1024)}).encode()
    declared = client.post("/v1/songs", content=big, headers=AS_JSON)
    assert declared.status_code == 413 and "262144 bytes" in error_of(declared)["message"]
    chunked = iter([big[:100_000], big[100_000:]])  # no length
    streamed = client.post("/v1/songs", content=chunked, headers=AS_JSON)
    assert streamed.status_code == 413
    assert client.get("/v1/songs").json()["songs"] == []


def test_an_idempotency_key_returns_the_same_job_or_422_for_another_body(serve):
    client = serve().client
    key = {"Idempotency-Key": "order-1234"}
    first = client.post("/v1/songs", json=SONG, headers=key)
    spelled = json.dumps(SONG, indent=2)  # the same body, spelled otherwise
    again = client.post("/v1/songs", content=spelled, headers={**key, **AS_JSON})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["created"] is False
    other = client.post("/v1/songs", json={**SONG, "seed": 8}, headers=key)
    assert other.status_code == 422 and error_of(other)["field"] == "Idempotency-Key"
    assert first.json()["id"] in error_of(other)["message"]
    for bad in ("", "with space", "k" * 256):
        assert client.post("/v1/songs", json=SONG, headers={"Idempotency-Key": bad}).status_code == 422
    assert [s["id"] for s in client.get("/v1/songs").json()["songs"]] == [first.json()["id"]]
    final(client, first.json()["id"])


def test_a_full_queue_is_429_and_cancel_works_queued_running_and_finished(serve, tmp_path):
    server = serve(concurrency=1, queue_size=2)
    client = server.client
    running = submit(client, **LONG)
    wait_for(lambda: client.get(running["urls"]["self"]).json(), lambda d: d["progress"]["semantic"]["tokens"] > 0)
    queued = [submit(client), submit(client)]
    full = client.post("/v1/songs", json=SONG)
    assert full.status_code == 429 and "queue is full (2 of 2" in error_of(full)["message"]
    assert 1 <= int(full.headers["retry-after"]) <= 60
    assert client.get(queued[0]["urls"]["self"]).json()["queue_position"] == 0
    for name in ("audio", "score", "result"):  # nothing is ready yet
        not_ready = client.get(queued[0]["urls"][name])
        assert not_ready.status_code == 409 and "not ready (status queued)" in error_of(not_ready)["message"]

    cancelled = cancel(client, queued[0])  # queued: cancelled at once, it never starts
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["error"]["message"] == "cancelled before it started"
    later = submit(client)  # its slot is free again
    stopping = cancel(client, running)  # running: stops at the next token
    assert stopping.status_code == 202 and stopping.json()["cancel_requested"] is True
    doc = final(client, running["id"])
    assert doc["status"] == "cancelled" and doc["error"]["type"] in ("InterruptedError", "Cancelled")
    directory = tmp_path / "data" / "jobs" / running["id"]
    assert json.loads((directory / "run_state.json").read_text())["state"] == "cancelled"
    assert (directory / "plan.stage.json").exists()  # a cancelled job's verified stages stay
    assert not (tmp_path / "data" / "jobs" / queued[0]["id"]).exists()
    for job in (queued[1], later):
        assert final(client, job["id"])["status"] == "complete"
    done = cancel(client, later)  # finished: nothing to cancel, the job as it is, its files stay
    assert done.status_code == 200 and done.json()["status"] == "complete"
    assert client.get(later["urls"]["audio"]).status_code == 200
    again = cancel(client, queued[0])  # idempotent on an ended job
    assert again.status_code == 200 and again.json() == client.get(queued[0]["urls"]["self"]).json()
    assert final(client, queued[0]["id"])["status"] == "cancelled"


def test_a_stopping_server_requeues_its_songs_even_when_the_transcription_pool_fails_to_close(serve, tmp_path,
                                                                                            monkeypatch):
    from yue2_vllm.serve.transcribing import TranscriptionPool

    def fails(pool):
        raise OSError("the pool's workers cannot be signalled")

    monkeypatch.setattr(TranscriptionPool, "close", fails)
    server = serve(concurrency=1)
    running = submit(server.client, **LONG)
    wait_for(lambda: server.client.get(running["urls"]["self"]).json(),
             lambda d: d["progress"]["semantic"]["tokens"] > 0)
    server.stop()
    record = JobStore(tmp_path / "data" / "jobs.sqlite3").get(running["id"])
    assert (record.status, [entry["kind"] for entry in record.retries]) == ("queued", ["shutdown"]), record


def test_delete_removes_a_job_at_once_and_its_files_once_it_stopped(serve, tmp_path):
    server = serve(concurrency=1)
    client, jobs = server.client, tmp_path / "data" / "jobs"
    keep = submit(client, stage="plan")
    done = submit(client, headers={"Idempotency-Key": "delete-me"})
    assert final(client, keep["id"])["status"] == final(client, done["id"])["status"] == "complete"
    kept = stage_records(jobs / keep["id"])
    running = submit(client, **LONG)
    wait_for(lambda: client.get(running["urls"]["self"]).json(), lambda d: d["progress"]["semantic"]["tokens"] > 0)
    queued = submit(client)

    gone = client.delete(done["urls"]["self"])  # nothing runs: its files and row go now
    assert gone.status_code == 204 and gone.content == b""
    assert not (jobs / done["id"]).exists() and server.service.store.get(done["id"]) is None
    for name in ("self", "events", "audio", "score", "result"):
        assert client.get(done["urls"][name]).status_code == 404, name
    assert client.head(done["urls"]["audio"]).status_code == 404
    for verb in ("cancel", "resume", "render"):
        assert client.post(f"{done['urls']['self']}/{verb}").status_code == 404, verb
    assert client.delete(done["urls"]["self"]).status_code == 404
    again = client.post("/v1/songs", json=SONG, headers={"Idempotency-Key": "delete-me"})  # the key names no job now
    assert again.status_code == 202 and again.json()["id"] != done["id"]

    assert client.delete(queued["urls"]["self"]).status_code == 204  # queued: it never starts
    assert client.get(queued["urls"]["self"]).status_code == 404 and not (jobs / queued["id"]).exists()

    stopping = client.delete(running["urls"]["self"])  # running: gone for clients now, its files once it stops
    assert stopping.status_code == 202, stopping.text
    assert stopping.json()["id"] == running["id"] and stopping.json()["cancel_requested"] is True
    for name in ("self", "events", "audio", "score", "result"):
        assert client.get(running["urls"][name]).status_code == 404, name
    assert running["id"] not in [s["id"] for s in client.get("/v1/songs").json()["songs"]]
    assert client.delete(running["urls"]["self"]).status_code == 404
    wait_for(lambda: server.service.store.get(running["id"]), lambda record: record is None, timeout=60)
    assert not (jobs / running["id"]).exists()

    assert final(client, again.json()["id"])["status"] == "complete"
    assert [s["id"] for s in client.get("/v1/songs").json()["songs"]] == [again.json()["id"], keep["id"]]
    assert stage_records(jobs / keep["id"]) == kept and client.get(keep["urls"]["score"]).status_code == 200
    assert sorted(p.name for p in jobs.iterdir()) == sorted([keep["id"], again.json()["id"]])  # no *.purging left
    assert "yue2_jobs_purged_total 3.0" in client.get("/metrics").text


def test_a_download_outlives_the_removal_of_its_file(tmp_path):
    """The audio answer holds its file open: a DELETE that removes the job while the bytes go out cuts nothing."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    path, data = tmp_path / "audio.flac", os.urandom(300_000)

    def download(request):
        path.write_bytes(data)
        response = OpenFileResponse(open(path, "rb"), media_type="audio/flac")
        path.unlink()  # as a DELETE would, between the answer and its bytes
        return response

    with TestClient(Starlette(routes=[Route("/audio", download)])) as client:
        whole = client.get("/audio")
        assert whole.status_code == 200 and whole.content == data
        ranged = client.get("/audio", headers={"Range": "bytes=100-199"})
        assert ranged.status_code == 206 and ranged.content == data[100:200]
        assert ranged.headers["content-range"] == f"bytes 100-199/{len(data)}"


def test_ids_are_validated_before_anything_is_read(serve, tmp_path):
    server = serve()
    job = submit(server.client, stage="plan")
    final(server.client, job["id"])
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    url = urlparse(server.url)
    paths = ["/v1/songs/../x", "/v1/songs/%2e%2e", "/v1/songs/%2e%2e/result", "/v1/songs/..%2F..%2Fjobs.sqlite3",
             "/v1/songs/%2Fetc%2Fpasswd/audio", "/v1/songs//etc/passwd/score", f"/v1/songs/{tmp_path}/result",
             "/v1/songs/j" + "0" * 20, "/v1/songs/J" + "0" * 20, f"/v1/songs/{job['id']}x/score",
             f"/v1/songs/{job['id'][:-1]}/score", f"/v1/songs/{job['id'].upper()}", "/v1/songs/jobs.sqlite3/result",
             "/static/..%2Fapp.py", "/static/../service.py", "/static/vendor/../../app.py",
             "/static/vendor/..%2F..%2Fapp.py"]
    for method in ("GET", "DELETE", "POST"):
        for path in paths:
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            target = path + ("/render" if method == "POST" and "/v1/" in path else "")
            connection.request(method, target)  # sent as written: no client-side normalisation
            response = connection.getresponse()
            body = response.read()
            assert response.status in (404, 405), (method, target, response.status)
            if response.status == 404:
                assert json.loads(body)["error"]["status"] == 404, (method, target)
            connection.close()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if not p.name.endswith(("-wal", "-shm"))) \
        == [p for p in before if not p.name.endswith(("-wal", "-shm"))]


def test_an_api_key_guards_v1_and_metrics_but_not_health(serve):
    key = "s3cret-key-0123456789"
    client = serve(api_key=key).client
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": f"Basic {key}"},
                    {"Authorization": key}):
        for method, path in (("GET", "/v1/songs"), ("POST", "/v1/songs"), ("GET", "/metrics"),
                             ("GET", "/v1/songs/j" + "0" * 20 + "/events")):
            response = client.request(method, path, headers=headers, json=SONG)
            assert response.status_code == 401, (headers, path)
            assert response.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
    good = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/songs", headers=good).status_code == 200
    assert client.get("/metrics", headers=good).status_code == 200
    job = submit(client, headers=good, stage="plan")
    assert final(client.__class__(base_url=client.base_url, headers=good), job["id"])["status"] == "complete"


def test_the_page_and_every_module_it_imports_are_served_as_javascript_under_the_csp(serve):
    """The page is ES modules (no build step): each import resolves to a file the server gives with the JavaScript
    type (browsers refuse a module of any other) and the page's headers; the one script tag names the entry module."""
    client = serve().client
    page = client.get("/")
    assert page.headers["content-security-policy"].startswith("default-src 'self';")
    assert re.findall(r"<script[^>]*>", page.text) == ['<script type="module" src="/static/main.js">']
    seen, todo = set(), ["main.js"]
    while todo:
        name = todo.pop()
        seen.add(name)
        response = client.get(f"/static/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == "text/javascript; charset=utf-8", name
        assert response.headers["content-security-policy"] == page.headers["content-security-policy"], name
        assert response.headers["x-content-type-options"] == "nosniff", name
        imports = re.findall(r'^import .* from "\./([a-z]+\.js)";$', response.text, flags=re.M)
        assert len(imports) == response.text.count("\nimport "), name  # every import is a local file's
        todo += [target for target in imports if target not in seen]
    shipped = {p.name for p in (Path(__file__).parent.parent / "yue2_vllm" / "serve" / "static").glob("*.js")}
    assert seen == shipped  # no module is left unused
    assert client.get("/static/style.css").headers["content-type"] == "text/css; charset=utf-8"
    assert client.get("/static/app.js").status_code == 404
    # the notation renderer the score panel loads (a classic script: abcjs is UMD), and its licence, from this server
    assert 'const RENDERER = "/static/vendor/abcjs-basic-min.js";' in client.get("/static/notation.js").text
    renderer = client.get("/static/vendor/abcjs-basic-min.js")
    assert renderer.status_code == 200 and renderer.headers["content-type"] == "text/javascript; charset=utf-8"
    assert renderer.headers["content-security-policy"] == page.headers["content-security-policy"]
    licence = client.get("/static/vendor/abcjs-LICENSE.txt")
    assert licence.headers["content-type"] == "text/plain; charset=utf-8" and "Paul Rosen" in licence.text
    for name in ("vendor", "vendor/", "vendor/abcjs.js", "vendor%2F..%2F..%2Fapp.py", "vendor/abcjs-basic.js"):
        assert client.get(f"/static/{name}").status_code == 404, name


def test_the_vendored_renderer_is_the_release_the_docs_name():
    """docs/serving.md records where static/vendor/abcjs-basic-min.js came from: the file is that release's."""
    import hashlib

    from yue2_vllm.serve.routes.page import PAGE_HEADERS, RENDERER_STYLES, style_hashes

    root = Path(__file__).parent.parent
    vendored = (root / "yue2_vllm" / "serve" / "static" / "vendor" / "abcjs-basic-min.js").read_bytes()
    record = re.search(r"abcjs\S* (\d+\.\d+\.\d+)\b.*?sha256 `([0-9a-f]{64})`",
                       (root / "docs" / "serving.md").read_text(encoding="utf-8"), re.S)
    assert record, "docs/serving.md names the vendored abcjs release and its sha256"
    assert hashlib.sha256(vendored).hexdigest() == record.group(2)
    assert f"abcjs_basic v{record.group(1)} ".encode() in vendored[:2000]
    # the few inline styles it sets while drawing are allowed by their hashes, and no other inline style (the page
    # test sees no CSP violation while a score is drawn)
    assert b'["display: block !important;","height: 1px;","width: 1px;","position: absolute;"].join("")' in vendored
    assert b'".abcjs-dragging-in-progress text, .abcjs-dragging-in-progress tspan {"+' in vendored
    assert b'setAttribute("style","font-size:0.7em")' in vendored
    policy = PAGE_HEADERS["Content-Security-Policy"]
    assert f"style-src 'self' 'unsafe-hashes' {style_hashes(RENDERER_STYLES)};" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy


def test_a_signed_audio_url_plays_without_the_key_and_the_picture_is_computed_once(serve, tmp_path):
    import base64
    import time

    import httpx

    from yue2_vllm.serve.signed import signed_audio_query, signing_key

    key = "s3cret-key-0123456789"
    server = serve(api_key=key)
    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    job = submit(client)
    queued = client.get(f"/v1/songs/{job['id']}/audio-url")
    assert queued.status_code == 409  # nothing to play yet
    assert final(client, job["id"])["status"] == "complete"
    signed = client.get(f"/v1/songs/{job['id']}/audio-url").json()
    assert signed["url"].startswith(f"/v1/songs/{job['id']}/audio?expires=") and signed["expires_in"] == 900
    assert abs(signed["expires"] - 900 - time.time()) < 5
    flac = (tmp_path / "data" / "jobs" / job["id"] / "audio.flac").read_bytes()
    anyone = server.client  # no key
    assert anyone.get(job["urls"]["audio"]).status_code == 401
    whole = anyone.get(signed["url"])
    assert whole.status_code == 200 and whole.content == flac
    part = anyone.get(signed["url"], headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == flac[10:20]  # the player streams: Range requests
    other = submit(client, stage="plan")["id"]
    for url, words in ((signed["url"].replace(job["id"], other), "signature is wrong"),
                       (signed["url"][:-1] + ("0" if signed["url"][-1] != "0" else "1"), "signature is wrong"),
                       (f"{job['urls']['audio']}?" + signed_audio_query(signing_key(key), job["id"], time.time() - 1000)[0],
                        "expired"),
                       (f"{job['urls']['audio']}?" + signed_audio_query(signing_key(key), job["id"], time.time(),
                                                                         lifetime=86400)[0], "later than")):
        refused = anyone.get(url)
        assert refused.status_code == 401 and words in refused.json()["error"]["message"], (url, refused.text)
    assert anyone.get(f"/v1/songs/{job['id']}/peaks").status_code == 401
    assert anyone.get(f"/v1/songs/{job['id']}/audio-url").status_code == 401

    picture = client.get(f"/v1/songs/{job['id']}/peaks")
    assert picture.status_code == 200 and len(picture.content) < 120_000  # for a song of any length
    document = picture.json()
    assert document["duration"] == (12 * 1920 - 64) / 48000 and len(document["peaks"]) == 2
    assert len(base64.b64decode(document["spectrogram"])) == document["columns"] * document["rows"]
    cache = tmp_path / "data" / "jobs" / job["id"] / "page-cache" / "picture.json"
    written = cache.stat().st_mtime_ns
    assert client.get(f"/v1/songs/{job['id']}/peaks").json() == document and cache.stat().st_mtime_ns == written
    assert "page-cache" not in verify_result(tmp_path / "data" / "jobs" / job["id"])["artifacts"]
    assert client.get(f"/v1/songs/{other}/peaks").status_code == 409  # a plan-only job has no audio
    client.close()


def test_the_list_is_newest_first_with_filters_and_cursors(serve):
    client = serve().client
    jobs = [submit(client, stage="plan", seed=n) for n in range(3)]
    for job in jobs:
        final(client, job["id"])
    cancelled = submit(client, **LONG)
    cancel(client, cancelled)
    final(client, cancelled["id"])
    page = client.get("/v1/songs", params={"limit": 2}).json()
    assert [s["id"] for s in page["songs"]] == [cancelled["id"], jobs[2]["id"]]
    rest = client.get("/v1/songs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert [s["id"] for s in rest["songs"]] == [jobs[1]["id"], jobs[0]["id"]] and rest["next_cursor"] is None
    complete = client.get("/v1/songs", params={"status": "complete"}).json()["songs"]
    assert [s["id"] for s in complete] == [j["id"] for j in reversed(jobs)]
    assert complete[0]["seed"] == 2 and complete[0]["style"] == "pop, piano" and complete[0]["stage"] == "plan"
    both = client.get("/v1/songs", params={"status": "cancelled,complete"}).json()["songs"]
    assert len(both) == 4
    for params, field in (({"status": "done"}, "status"), ({"limit": 0}, "limit"), ({"limit": 201}, "limit"),
                          ({"cursor": "abc"}, "cursor")):
        response = client.get("/v1/songs", params=params)
        assert response.status_code == 422 and error_of(response)["field"] == field, params


def test_plan_first_then_render_reuses_the_verified_plan(serve, tmp_path):
    client = serve().client
    job = submit(client, stage="plan")
    doc = final(client, job["id"])
    assert doc["status"] == "complete" and set(doc["stages"]) == {"plan"} and doc["stage"] == "plan"
    directory = tmp_path / "data" / "jobs" / job["id"]
    assert client.get(job["urls"]["score"]).content == (directory / "score.abc").read_bytes()
    audio = client.get(job["urls"]["audio"])
    assert audio.status_code == 409 and "/render" in error_of(audio)["message"]
    assert client.get(job["urls"]["result"]).status_code == 409
    plan = (directory / "plan.stage.json").read_bytes()
    rendering = client.post(f"{job['urls']['self']}/render")
    assert rendering.status_code == 202 and rendering.json()["status"] == "queued"
    doc = final(client, job["id"])
    assert doc["status"] == "complete" and doc["stage"] == "audio" and doc["stages"]["plan"]["state"] == "reused"
    assert (directory / "plan.stage.json").read_bytes() == plan and client.get(job["urls"]["audio"]).status_code == 200
    assert [r["kind"] for r in doc["retries"]] == ["render"]
    assert client.post(f"{job['urls']['self']}/render").status_code == 409
    verify_result(directory)


def test_a_cancelled_song_resumes_from_its_last_verified_stage(serve, tmp_path):
    client = serve().client
    job = submit(client, semantic_sampling={"min_tokens": 200, "max_tokens": 200})
    wait_for(lambda: client.get(job["urls"]["self"]).json(), lambda d: d["progress"]["semantic"]["tokens"] >= 3)
    assert cancel(client, job).status_code == 202
    assert final(client, job["id"])["status"] == "cancelled"
    directory = tmp_path / "data" / "jobs" / job["id"]
    plan = (directory / "plan.stage.json").read_bytes()
    assert client.post(f"{job['urls']['self']}/resume").status_code == 202
    wait_for(lambda: client.get(job["urls"]["self"]).json(), lambda d: d["progress"]["semantic"]["tokens"] >= 3)
    assert cancel(client, job).status_code == 202  # and once more, to make it quick
    doc = final(client, job["id"])
    assert doc["status"] == "cancelled" and doc["stages"]["plan"]["state"] == "reused"
    assert (directory / "plan.stage.json").read_bytes() == plan
    assert [r["kind"] for r in doc["retries"]] == ["resume"] and doc["attempts"] == 2
    assert client.post(f"{job['urls']['self']}/resume").status_code == 202
    cancel(client, job)
    final(client, job["id"])
    busy = submit(client, **LONG)
    resume_running = client.post(f"{busy['urls']['self']}/resume")
    assert resume_running.status_code == 409 and "only a failed or cancelled job" in error_of(resume_running)["message"]
    cancel(client, busy)
    final(client, busy["id"])


def test_a_restart_resumes_unfinished_jobs_and_keeps_a_cancel_asked_before_it(pipe, tmp_path):
    (tmp_path / "data").mkdir()
    store = JobStore(tmp_path / "data" / "jobs.sqlite3")  # what a crashed server left behind
    request = {"style": "pop", "lyrics": "la", "cot": "full", "seed": 3, "abc": None, "cfg_scale": None}
    stages = {s: {"state": "pending"} for s in ("plan", "semantic", "synthesis", "audio")}
    for number, status, cancel in ((1, "generating", 0), (2, "planning", 1), (3, "queued", 0), (4, "generating", 0)):
        job_id = f"j{number:020x}"
        store.admit(NewJob(job_id, None, "audio", {**request, "id": job_id}, {}, str(number), None, stages), None)
        store.update(job_id, status=status, cancel_requested=cancel)
    store.mark_deleted(f"j{4:020x}")  # DELETEd while it ran: the server died before it stopped
    (tmp_path / "data" / "jobs" / f"j{4:020x}").mkdir(parents=True)
    store.close()
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data")))
    try:
        docs = {n: final(server.client, f"j{n:020x}") for n in (1, 2, 3)}
    finally:
        server.stop()
    assert [docs[n]["status"] for n in (1, 2, 3)] == ["complete", "cancelled", "complete"]
    assert docs[1]["retries"][0]["reason"] == "server restarted while generating" and docs[3]["retries"] == []
    assert not (tmp_path / "data" / "jobs" / f"j{2:020x}").exists()
    assert not (tmp_path / "data" / "jobs" / f"j{4:020x}").exists()  # removed at the start, never resumed
    store = JobStore(tmp_path / "data" / "jobs.sqlite3")
    assert store.get(f"j{4:020x}") is None
    store.close()


# --------------------------------------------------------------------------- the command


def test_serve_refuses_bad_flags_a_busy_port_and_a_data_dir_in_use(tmp_path, capsys):
    assert main(["serve", "--api-key", "short", "--data-dir", str(tmp_path / "a")]) == 2
    assert "at least 16 characters" in json.loads(capsys.readouterr().out)["reason"]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    assert main(["serve", "--port", str(busy.getsockname()[1]), "--data-dir", str(tmp_path / "b")]) == 2
    assert "Address already in use" in json.loads(capsys.readouterr().out)["reason"]
    busy.close()
    with data_dir_lock(tmp_path / "c"):
        assert main(["serve", "--port", "0", "--data-dir", str(tmp_path / "c")]) == 2
    assert f"in use by another yue2-vllm serve (pid {os.getpid()})" in json.loads(capsys.readouterr().out)["reason"]
    code = "import sys, yue2_vllm, yue2_vllm.cli, yue2_vllm.scheduler; " \
           "print(sorted(m for m in ('fastapi', 'uvicorn', 'vllm', 'starlette') if m in sys.modules))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"


def test_kill_9_mid_song_then_restart_completes_every_job_without_redoing_verified_stages(
        tiny_model_dir, tiny_vae_dir, tmp_path):
    config = tmp_path / "generation.json"
    config.write_text(json.dumps({"abc": {"max_tokens": 6, "min_tokens": 6},
                                  "semantic": {"max_tokens": 40, "min_tokens": 40}, "ode_steps": 8}))
    args = ["--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--backend", "torch", "--config",
            str(config), "--max-concurrency", "2", "--data-dir", str(tmp_path / "data")]
    server = ProcessServer(args, log=tmp_path / "serve.log")
    server.wait_healthy()
    jobs = [submit(server.client, seed=n)["id"] for n in range(3)]

    def mid_song():
        docs = [server.client.get(f"/v1/songs/{j}").json() for j in jobs]
        started = [d for d in docs if d["stages"]["semantic"]["state"] == "done" and d["status"] not in FINAL]
        return started and any(d["status"] != "complete" for d in docs)

    wait_for(mid_song, bool, timeout=180, interval=0.02)
    server.kill()  # SIGKILL
    jobs_dir = tmp_path / "data" / "jobs"
    verified = {j: stage_records(jobs_dir / j) for j in jobs if (jobs_dir / j).exists()}
    assert any(records and not (jobs_dir / j / "result.json").exists() for j, records in verified.items())

    again = ProcessServer(args, log=tmp_path / "serve.log")
    docs = {j: final(again.client, j, timeout=300) for j in jobs}
    assert {d["status"] for d in docs.values()} == {"complete"}, docs
    for job_id, doc in docs.items():
        verify_result(jobs_dir / job_id)
        for name, data in verified.get(job_id, {}).items():  # verified before the kill: kept, not redone
            assert (jobs_dir / job_id / name).read_bytes() == data, (job_id, name)
            stage = name.split(".")[0]
            assert doc["stages"][stage]["state"] in ("done", "reused")
        if verified.get(job_id) and "audio.stage.json" not in verified[job_id]:  # it was mid-song
            assert doc["attempts"] == 2 and [r["kind"] for r in doc["retries"]] == ["restart"]
            assert all(doc["stages"][name.split(".")[0]]["state"] == "reused" for name in verified[job_id])
    listing = again.client.get("/v1/songs").json()["songs"]
    assert sorted(s["id"] for s in listing) == sorted(jobs)
    assert again.stop() == 0
    assert json.loads(again.process.stdout.read().decode().strip().splitlines()[-1]) == {"status": "stopped"}


# --------------------------------------------------------------------------- the vLLM engine


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_on_the_vllm_engine_a_killed_worker_is_restarted_and_its_songs_retried(tiny_model_dir, tiny_vae_dir,
                                                                                tmp_path):
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        ar=AROptions(backend="vllm", cfg_engine="torch"),
                        engine=EngineOptions(max_num_seqs=4, max_num_batched_tokens=64, start=True,
                                             tuning={"max_restarts": 2}))
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=4)))
    client = server.client
    try:
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=300)
        assert client.get("/health").json()["engine"]["state"] == "running"
        plain, guided = submit(client), submit(client, cfg_scale=1.5)
        doc = final(client, plain["id"])
        assert doc["status"] == "complete" and doc["stages"]["semantic"]["backend_actual"] == "vllm"
        doc = final(client, guided["id"])
        assert doc["stages"]["semantic"]["backend_actual"] == "torch"
        assert "--cfg-engine torch" in doc["stages"]["semantic"]["fallback_reason"]
        assert 'yue2_fallbacks_total{phase="semantic",reason="cfg_scale N ≠ N"} 1.0' in client.get("/metrics").text

        long = submit(client, semantic_sampling={"min_tokens": 400, "max_tokens": 400})
        wait_for(lambda: client.get(long["urls"]["self"]).json(), lambda d: d["progress"]["semantic"]["tokens"] >= 20)
        os.killpg(pipe.engine.process.pid, signal.SIGKILL)
        down = wait_for(lambda: client.get("/health"), lambda r: r.status_code == 503, timeout=30)
        assert down.json()["engine"]["state"] == "restarting"
        wait_for(lambda: client.get("/health"), lambda r: r.status_code == 200, timeout=300)
        doc = final(client, long["id"], timeout=300)
        assert doc["status"] == "complete" and doc["attempts"] == 2
        assert [r["kind"] for r in doc["retries"]] == ["engine"] and "AR engine failed" in doc["retries"][0]["reason"]
        assert doc["stages"]["plan"]["state"] == "reused"
        verify_result(tmp_path / "data" / "jobs" / long["id"])
        metrics = client.get("/metrics").text
        assert "yue2_engine_restarts_total 1.0" in metrics and "yue2_engine_retries_total 1.0" in metrics
        assert client.get("/health").json()["engine"]["restarts"] == 1
    finally:
        server.stop()
        pipe.close()


# --------------------------------------------------------------------------- before the app is up


def test_health_answers_503_with_the_start_up_phase_from_the_moment_the_port_is_bound(tiny_model_dir, tiny_vae_dir,
                                                                                      tmp_path):
    import time

    from yue2_vllm.checkpoint import weights_bytes

    config = tmp_path / "gen.json"
    config.write_text(json.dumps(GENERATION))
    args = ["--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--backend", "torch", "--config",
            str(config), "--data-dir", str(tmp_path / "data")]
    # The MoT load takes 4 s more than it does: the window a real 7 GB load (minutes) opens.
    server = ProcessServer(args, env={"YUE2_TEST_LOAD_DELAY_S": "4"}, log=tmp_path / "serve.log", serving=False)
    try:
        bound = time.monotonic()
        first = server.client.get("/health", timeout=5)  # answered at once, not left in the backlog
        assert first.status_code == 503 and first.headers["retry-after"] == "5", first.text
        phases = [first.json()["startup"]["phase"]]
        loading = wait_for(lambda: server.client.get("/health", timeout=5),
                           lambda r: r.json()["startup"]["phase"] == "loading", timeout=60, interval=0.05)
        document = loading.json()
        assert document["status"] == "unavailable" and document["engine"]["state"] == "starting"
        size = weights_bytes(tiny_model_dir)
        assert document["problems"] == [f"the server is starting: loading model (0 of {size} bytes)"]
        steps = {step["phase"]: step for step in document["startup"]["steps"]}
        assert steps["hashing"]["finished"] and steps["loading"]["total_bytes"] == weights_bytes(tiny_model_dir)
        phases.append("loading")
        refused = server.client.post("/v1/songs", json={"style": "a", "lyrics": "b"}, timeout=5)
        assert refused.status_code == 503 and "the server is starting (loading)" in refused.json()["error"]["message"]
        assert server.client.head("/health", timeout=5).status_code == 503
        server.wait_serving()
        healthy = server.wait_healthy(timeout=120)  # then today's /health: the app's own document
        assert healthy["status"] == "ok" and "startup" not in healthy
        ready = time.monotonic() - bound
        assert ready > 4  # the 503 answers covered the whole slowed start-up
    finally:
        assert server.stop() == 0
