"""POST /v1/audio/speech waiting for its songs against a real server (`yue2-vllm serve` in a subprocess): the calls
that wait hold no worker thread, so every other route answers at once; the call past --max-waiting-calls is a 503
naming the bound; SIGTERM answers every waiting call (503 naming its job, which resumes at the next start) and
stops the server; a job deleted under a waiting call answers it at once. OpenAI's client on this route, the 504 past --speech-timeout and the refusals:
tests/test_serve_adapters.py."""
import json
import threading
import time

import httpx

from serving import ProcessServer, ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.serve.store import JobStore

CALLS = 48
LYRICS = "[verse]\nla la la\n"
# The tiny default model, on torch (one song at a time), with songs long enough that none ends during the test.
LONG = {"semantic": {"min_tokens": 3000, "max_tokens": 3000}}


def speech(n: int) -> dict:
    return {"model": "yue2", "voice": f"call-{n}", "input": LYRICS, "instructions": "pop, piano"}


def answered_within(seconds: float, call) -> httpx.Response:
    """`call()`'s answer, which must come within `seconds`."""
    started = time.monotonic()
    response = call()
    elapsed = time.monotonic() - started
    assert elapsed < seconds, f"answered after {elapsed:.1f} s: {response.request.method} {response.request.url}"
    return response


def test_48_waiting_speech_calls_leave_every_route_answering_and_sigterm_answers_them(tmp_path):
    config = tmp_path / "generation.json"
    config.write_text(json.dumps(LONG), encoding="utf-8")
    server = ProcessServer(["--backend", "torch", "--config", str(config), "--data-dir", str(tmp_path / "data"),
                            "--max-waiting-calls", str(CALLS)], log=tmp_path / "serve.log")
    answers: dict[int, httpx.Response | httpx.HTTPError] = {}

    def call(n: int) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            try:
                answers[n] = client.post("/v1/audio/speech", json=speech(n))
            except httpx.HTTPError as exc:  # no answer: the assertions below name it
                answers[n] = exc

    callers = [threading.Thread(target=call, args=(n,), daemon=True) for n in range(CALLS)]
    try:
        server.wait_healthy()
        for caller in callers:
            caller.start()
        # Every call has queued its song and waits for it (none can end: each song is minutes long).
        listing = wait_for(lambda: server.client.get("/v1/songs", params={"limit": 200}).json()["songs"],
                           lambda songs: len(songs) == CALLS, timeout=120, interval=0.2)
        assert sorted(song["label"] for song in listing) == sorted(f"call-{n}" for n in range(CALLS))
        assert not answers, answers

        health = answered_within(2, lambda: server.client.get("/health", timeout=2))
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        songs = answered_within(2, lambda: server.client.get("/v1/songs", timeout=2))
        assert songs.status_code == 200 and len(songs.json()["songs"]) == CALLS
        posted = answered_within(2, lambda: server.client.post("/v1/songs", timeout=2, json={
            "style": "pop", "lyrics": LYRICS}))
        assert posted.status_code == 202, posted.text
        beyond = answered_within(2, lambda: server.client.post("/v1/audio/speech", timeout=2, json=speech(CALLS)))
        assert beyond.status_code == 503 and beyond.headers["retry-after"].isdigit(), beyond.text
        assert beyond.json()["error"]["message"].startswith(
            f"{CALLS} speech calls are waiting for their songs, the most this server keeps (--max-waiting-calls "
            f"{CALLS})"), beyond.text
        assert len(server.client.get("/v1/songs", params={"limit": 200}).json()["songs"]) == CALLS + 1  # none queued
        assert not answers

        streamed, opened = [], threading.Event()  # an event stream open too: it ends as the server stops

        def stream() -> None:
            with httpx.Client(base_url=server.url, timeout=300) as client, \
                    client.stream("GET", f"/v1/songs/{listing[0]['id']}/events") as events:
                for line in events.iter_lines():
                    if line.startswith("event: "):
                        streamed.append(line[7:])
                        opened.set()

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert opened.wait(30)
        started = time.monotonic()
        assert server.stop(timeout=60) == 0
        stopped = time.monotonic() - started
        for caller in [*callers, streamer]:
            caller.join(timeout=30)
        assert len(answers) == CALLS, f"{CALLS - len(answers)} waiting calls were never answered"
        assert not streamer.is_alive() and streamed[0] == "status" and not {"complete", "failed"} & set(streamed)
    finally:
        if server.process.poll() is None:
            server.kill()
    ids = set()
    for n, answer in answers.items():
        assert isinstance(answer, httpx.Response), f"call {n}: {answer!r}"
        job = answer.headers.get("x-song-id")
        assert answer.status_code == 503 and answer.headers["location"] == f"/v1/songs/{job}", answer.text
        assert answer.json()["error"]["message"] == (
            f"the server stopped before the song {job} was made; it resumes when the server starts again: "
            f"GET /v1/songs/{job}, its audio at /v1/songs/{job}/audio"), answer.text
        ids.add(job)
    store = JobStore(tmp_path / "data" / "jobs.sqlite3")
    try:
        records = [store.get(job) for job in ids]
        assert {record.status for record in records} == {"queued"}  # put back: the next start resumes them
        assert sorted(record.label for record in records) == sorted(f"call-{n}" for n in range(CALLS))
    finally:
        store.close()
    assert stopped < 30, f"SIGTERM took {stopped:.1f} s with {CALLS} calls waiting"
    log = (tmp_path / "serve.log").read_text(encoding="utf-8")
    assert "Traceback" not in log and "Cancel " not in log, log[-3000:]


def test_a_job_deleted_under_its_waiting_call_answers_it_at_once(pipe, tmp_path):
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1)))
    answer: list[httpx.Response] = []
    try:
        ahead = server.client.post("/v1/songs", json={"style": "pop", "lyrics": LYRICS, **{
            "semantic_sampling": LONG["semantic"]}}).json()  # the one song in flight: the speech song stays queued
        caller = threading.Thread(target=lambda: answer.append(server.client.post("/v1/audio/speech",
                                                                                  json=speech(0))))
        caller.start()
        job = wait_for(lambda: [s for s in server.client.get("/v1/songs").json()["songs"] if s["label"] == "call-0"],
                       bool)[0]
        wait_for(lambda: server.service.hub.subscribers(job["id"]), lambda n: n == 1)  # the call waits on the hub
        assert not answer
        assert server.client.delete(job["urls"]["self"]).status_code == 204
        caller.join(timeout=30)
        assert answer[0].status_code == 404, answer[0].text
        assert answer[0].json()["error"]["message"] == f"no song {job['id']!r}"
        assert server.service.hub.subscribers(job["id"]) == 0
        documented = server.client.get("/openapi.json").json()["paths"]["/v1/audio/speech"]["post"]["responses"]
        assert "deleted while the call waits" in documented["404"]["description"], documented["404"]
        server.client.post(f"{ahead['urls']['self']}/cancel")
    finally:
        server.stop()
