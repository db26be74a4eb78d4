"""`yue2-vllm serve`'s HTTP face for standard clients and its safe defaults: line separators in an event stream read
by httpx-sse, cross-site and foreign-Host requests refused, no bind beyond loopback without a key, no server path
in any answer without the key, Idempotency-Key per the IETF draft, and the event-stream cap."""
import json
import re
import threading
import time

import httpx
import pytest

from yue2_vllm.cli import main
from yue2_vllm.serve.app import create_app, host_allowed, redact_text
from yue2_vllm.serve.events import EventHub
from yue2_vllm.serve.metrics import Registry
from yue2_vllm.serve.service import ServeConfig, SongService

from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)

httpx_sse = pytest.importorskip("httpx_sse", reason="pip install 'yue2-vllm[test]'")

SEPARATORS = "\u2028\u2029\u0085"
SONG = {"style": "pop\u2028piano", "lyrics": "[verse]\nla\u2028la\u2029la\u0085la\r\nla\n", "seed": 7}
JSON = {"Content-Type": "application/json"}
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/(?!v1/)[^\s'\"()<>\[\]{},;:/]+/")


@pytest.fixture
def serve(pipe, tmp_path):
    servers = []

    def start(api_key=None, service=None, **options):
        server = ThreadServer(service or SongService(pipe, ServeConfig(tmp_path / "data")), api_key=api_key,
                              **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def final(client, job_id, timeout=180) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                    lambda d: d["status"] in ("complete", "failed", "cancelled"), timeout)


# --------------------------------------------------------------------------- the event stream, read by httpx-sse


def test_line_separators_in_lyrics_reach_a_standard_sse_client_as_json(serve):
    client = serve().client
    job = client.post("/v1/songs", json=SONG).json()
    events, raw = [], b""
    with httpx_sse.connect_sse(client, "GET", job["urls"]["events"], timeout=120) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        for event in source.iter_sse():
            events.append((event.event, json.loads(event.data)))  # every data is JSON
            raw += event.data.encode()
            if event.event in ("complete", "failed", "cancelled"):
                break
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "status" and kinds[-1] == "complete", kinds
    assert events[0][1]["request"]["lyrics"] == SONG["lyrics"] and events[0][1]["request"]["style"] == SONG["style"]
    assert not any(separator.encode() in raw for separator in SEPARATORS)
    late = []  # once complete: the status (the whole job, lyrics included), then complete
    with httpx_sse.connect_sse(client, "GET", job["urls"]["events"]) as source:
        late = [(event.event, json.loads(event.data)) for event in source.iter_sse()]
    assert [kind for kind, _ in late] == ["status", "complete"]
    assert late[0][1]["request"]["lyrics"] == SONG["lyrics"]


def test_event_streams_are_capped(pipe, serve, tmp_path):
    service = SongService(pipe, ServeConfig(tmp_path / "data"))
    server = serve(service=service, max_sse_clients=1)
    client = server.client
    job = client.post("/v1/songs", json={**SONG, "semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}}).json()
    with client.stream("GET", job["urls"]["events"]) as first:
        assert first.status_code == 200
        wait_for(lambda: service.hub.subscribers(job["id"]), lambda n: n == 1, timeout=30)
        second = client.get(job["urls"]["events"])
        assert second.status_code == 503 and second.headers["retry-after"] == "5"
        assert "event streams are open" in second.json()["error"]["message"]
    client.post(f"{job['urls']['self']}/cancel")
    final(client, job["id"])
    wait_for(lambda: client.get(job["urls"]["events"]).status_code, lambda code: code == 200, timeout=30)


# --------------------------------------------------------------------------- cross-site requests and Hosts


def test_a_cross_site_post_is_refused_before_the_queue(serve):
    client = serve().client
    body = json.dumps(SONG)
    # What a page elsewhere can send without a preflight: text/plain, a form, no type at all.
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}, {}):
        response = client.post("/v1/songs", content=body, headers=headers)
        assert response.status_code == 415, (headers, response.text)
        assert response.json()["error"]["field"] == "Content-Type"
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": client.base_url.scheme + "://localhost:1"}):
        response = client.post("/v1/songs", content=body, headers={**JSON, **headers})
        assert response.status_code == 403 and response.json()["error"]["field"] == "Origin", headers
        assert client.delete("/v1/songs/j" + "0" * 20, headers=headers).status_code == 403
        assert client.post("/v1/songs/j" + "0" * 20 + "/resume", headers=headers).status_code == 403
        assert client.post("/v1/songs/j" + "0" * 20 + "/cancel", headers=headers).status_code == 403
    assert client.get("/v1/songs").json()["songs"] == []
    same = client.post("/v1/songs", content=body, headers={**JSON, "Origin": str(client.base_url).rstrip("/"),
                                                             "Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 202
    final(client, same.json()["id"])


def test_a_foreign_host_is_refused_and_allowed_hosts_are_served(serve):
    server = serve(allowed_hosts=("songs.example",))
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "songs.example.evil.example", "localhost.evil.example",
                 "", "[::1"):
        for path in ("/health", "/v1/songs", "/", "/openapi.json"):
            response = server.client.get(path, headers={"Host": host})
            assert response.status_code == 400, (host, path)
            assert response.json()["error"]["field"] == "Host"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", "songs.example", f"songs.example:{port}",
                 "10.1.2.3:80", "[::1]:80", "app.localhost"):
        assert server.client.get("/health", headers={"Host": host}).status_code == 200, host
    assert host_allowed("anything.example", ("*",)) and not host_allowed("anything.example", ())


def test_serve_refuses_a_bind_beyond_loopback_without_a_key(tmp_path, capsys):
    for host in ("0.0.0.0", "::", "192.0.2.10", "example.com"):
        assert main(["serve", "--host", host, "--port", "0", "--data-dir", str(tmp_path / "d")]) == 2
        reason = json.loads(capsys.readouterr().out)["reason"]
        assert "--api-key" in reason and "--insecure-no-auth" in reason, reason
    assert not (tmp_path / "d").exists()  # refused before anything is made


# --------------------------------------------------------------------------- no server paths without the key


class Counter:
    def inc(self, *args, **labels):
        pass


class PathsEverywhere:
    """A service whose every answer carries a server path (an engine failure, a verification error, ...)."""

    path = "/tmp/yue2-secret-8f3k/jobs/j00000000000000000000/audio.flac"

    def __init__(self):
        self.rules = type("Rules", (), {"reproducible": False})()
        self.hub, self.http_responses, self.metrics = EventHub(), Counter(), Registry(process=False)

    def start(self):
        pass

    def close(self):
        pass

    def doc(self, job_id):
        return {"id": job_id, "label": None, "status": "failed", "stage": "audio", "request": {"lyrics": "a /b/c"},
                "progress": {}, "retries": [{"reason": f"the AR engine failed ({self.path})"}],
                "stages": {"plan": {"state": "done", "fallback_reason": f"vllm at {self.path}: no"}},
                "error": {"type": "EngineError", "message": f"{self.path} is gone\nTraceback (most recent call "
                                                            "last):\n  File \"/usr/lib/x.py\", line 1"},
                "result": None, "urls": {k: "/v1/x" for k in ("self", "events", "audio", "score", "result")}}

    def document(self, job_id):
        return self.doc(job_id)

    def list(self, statuses, limit, cursor):
        return {"songs": [{**self.doc("j" + "1" * 20), "error": f"{self.path} failed"}], "next_cursor": None}

    def health(self):
        return {"status": "unavailable", "engine": {"state": "failed", "reason": f"worker died: see {self.path}"},
                "queue": {"depth": 0, "limit": 1}, "in_flight": 0, "concurrency": 1}, False

    def submit(self, body, key):
        from yue2_vllm.serve.errors import Unavailable

        raise Unavailable(f"the AR engine is down: {self.path}")

    def subscribe(self, job_id, loop):
        return self.hub.subscribe(job_id, loop, lambda: self.doc(job_id))


def answers_of(client) -> list[httpx.Response]:
    job = "/v1/songs/j" + "0" * 20
    responses = [client.get("/health"), client.get("/v1/songs"), client.get(job), client.get("/metrics"),
                 client.post("/v1/songs", json={"style": "a", "lyrics": "b"})]
    with client.stream("GET", job + "/events") as stream:
        responses.append(stream)
        stream.body = b"".join(stream.iter_bytes())
    return responses


def test_no_server_path_in_any_answer_without_the_key(serve):
    service = PathsEverywhere()
    open_server = serve(service=service)
    for response in answers_of(open_server.client):
        text = getattr(response, "body", None) or response.content
        text = text.decode()
        assert "yue2-secret" not in text and "/usr/lib" not in text and "Traceback" not in text, text
        assert not ABSOLUTE_PATH.search(text.replace("/v1/", "").replace("a /b/c", "")), text
    assert "…/audio.flac is gone" in open_server.client.get("/v1/songs/j" + "0" * 20).text
    assert "a /b/c" in open_server.client.get("/v1/songs/j" + "0" * 20).text  # what the client sent, as sent

    key = "paths-test-key-0123456789"
    guarded = serve(service=PathsEverywhere(), api_key=key)
    assert "yue2-secret" not in guarded.client.get("/health").text  # open, so without the key: redacted
    with_key = guarded.client.get("/health", headers={"Authorization": f"Bearer {key}"})
    assert service.path in with_key.text  # the operator sees where to look


def test_a_real_song_answers_without_a_server_path(serve, tmp_path, tiny_model_dir):
    client = serve().client
    job = client.post("/v1/songs", json=SONG).json()
    final(client, job["id"])
    for path in ("/health", "/v1/songs", job["urls"]["self"], job["urls"]["result"], job["urls"]["events"],
                 "/metrics", "/openapi.json"):
        text = client.get(path).text
        assert str(tmp_path) not in text and str(tiny_model_dir) not in text, path


def test_redaction_keeps_urls_and_words():
    assert redact_text("see /tmp/a/b.log and POST /v1/songs/j1/render, tok/s 3/4") == \
        "see …/b.log and POST /v1/songs/j1/render, tok/s 3/4"
    assert redact_text("boom\nTraceback (most recent call last):\n  x") == "boom\n(trace left out)"


# --------------------------------------------------------------------------- Idempotency-Key (IETF draft)


def test_an_idempotency_key_in_flight_is_409_and_reused_with_another_body_422(pipe, serve, tmp_path):
    service = SongService(pipe, ServeConfig(tmp_path / "data"))
    submit, gate = service.submit, threading.Event()

    def slow_submit(body, key):
        gate.wait(30)
        return submit(body, key)

    service.submit = slow_submit
    client = serve(service=service).client
    key = {"Idempotency-Key": "order-77", **JSON}
    results = {}
    first = threading.Thread(target=lambda: results.update(first=client.post("/v1/songs", json=SONG, headers=key)))
    first.start()
    time.sleep(0.5)
    busy = client.post("/v1/songs", json=SONG, headers=key)
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["field"] == "Idempotency-Key"
    gate.set()
    first.join(30)
    assert results["first"].status_code == 202
    again = client.post("/v1/songs", json=SONG, headers=key)
    assert again.status_code == 200 and again.json()["id"] == results["first"].json()["id"]
    other = client.post("/v1/songs", json={**SONG, "seed": 8}, headers=key)
    assert other.status_code == 422 and other.json()["error"]["field"] == "Idempotency-Key"
    final(client, again.json()["id"])
