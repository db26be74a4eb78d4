"""Covers and hums over HTTP on a real uvicorn server (serve/routes/transcriptions.py, serve/transcribing.py): POST
/v1/transcriptions answers the score and its records; POST /v1/covers transcribes, then queues an ordinary song job
that renders the score byte for byte with cot melody (on the torch backend here; the page's test makes one on vLLM)
and keeps the whole record beside it; POST /v1/songs takes a transcription record back with an edited score. Every
refusal names its field and leaves nothing behind: bad audio, bad knobs and fields, a body that is not multipart, an
upload past --max-upload-mb, a full transcription pool."""
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from melodies import synthesize, wav_bytes
from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)
from test_protocol import _record as record
from test_transcription_pyin import TWINKLE
from yue2_vllm.serve.service import ServeConfig, SongService

LIMIT = 2_000_000  # --max-upload-mb 2
LYRICS = "[verse]\nla la\n"
HUM = wav_bytes(synthesize(TWINKLE, 100, vibrato_semitones=0.2, noise_dbfs=-50))


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory):
    # One transcription at a time and none waiting: a second call while one runs is the pool's 429. SheetSage2 is
    # not set up (the pool's process, spawned on the first call, inherits the environment).
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("YUE2_SHEETSAGE_PYTHON", str(tmp_path_factory.mktemp("no-sheetsage") / "python"))
        data = tmp_path_factory.mktemp("covers") / "data"
        server = ThreadServer(SongService(pipe, ServeConfig(data, concurrency=1)), max_upload_bytes=LIMIT,
                              transcription_workers=1, transcription_queue=0)
        yield server
        server.stop()


def upload(audio: bytes, name: str = "hum.wav") -> dict:
    return {"audio": (name, audio, "audio/wav")}


def final(client, job_id) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                    lambda d: d["status"] in ("complete", "failed", "cancelled"), 180)


def test_importing_the_server_and_the_cli_imports_no_audio_analysis_library():
    code = ("import sys, yue2_vllm.serve.app, yue2_vllm.cli.main, yue2_vllm.cover\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('librosa', 'numba', 'scipy', 'soxr')))\n")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_transcription_answers_the_score_its_record_and_the_whole_record(server):
    from yue2_vllm.transcription import transcribe

    expected = transcribe(HUM, lyrics=LYRICS, bpm=100)
    answer = server.client.post("/v1/transcriptions", files=upload(HUM), data={"lyrics": LYRICS, "bpm": "100"},
                                timeout=300)
    assert answer.status_code == 200, answer.text
    document = answer.json()
    assert document["abc"] == expected.abc and document["transcription"] == expected.summary()
    record = {k: v for k, v in expected.record().items() if k != "timing"}
    assert {k: v for k, v in document["record"].items() if k != "timing"} == json.loads(json.dumps(record))
    assert [w["code"] for w in document["transcription"]["warnings"]] == ["syllables"]
    assert server.client.get("/v1/songs").json()["songs"] == []  # nothing is stored


SILENT = wav_bytes(np.zeros(32000, np.float32))
REFUSED = [  # (files, form fields, status, field, the message's start)
    ({"audio": ("notes.txt", b"these are not notes", "text/plain")}, {}, 422, "audio",
     "audio: not audio libsndfile reads"),
    (upload(wav_bytes(synthesize([(0, 0.5, 60)], 120, lead_seconds=0.05, tail_seconds=0.05))), {}, 422, "audio",
     "audio: 0.35 s is too short (at least 1 s)"),
    (upload(SILENT), {}, 422, "audio", "audio: silent (its loudest sample is -inf dBFS"),
    (upload(wav_bytes((0.3 * np.random.default_rng(0).standard_normal(48000)).astype(np.float32))), {}, 422,
     "audio", "audio: no pitched notes"),
    (upload(wav_bytes(np.zeros(1000 * 361, np.float32), 1000, subtype="PCM_16")), {}, 422, "audio",
     "audio: 361.0 s is too long (at most 360 s for this transcriber)"),
    (upload(HUM), {"bpm": "500"}, 422, "bpm", "bpm: 500.0 is outside 30-300 quarter notes a minute"),
    (upload(HUM), {"bpm": "fast"}, 422, "bpm", "bpm: expected a number, got 'fast'"),
    (upload(HUM), {"bpm": "nan"}, 422, "bpm", "bpm: expected a number, got nan"),
    (upload(HUM), {"meter": "4"}, 422, "meter", "meter: '4' is not a meter"),
    (upload(HUM), {"transcriber": "sheetsage2", "key": "G"}, 422, "key", "key: sheetsage2 finds the tempo"),
    (upload(HUM), {"transcriber": "sheetsage2"}, 503, "transcriber", "sheetsage2: "),
    (upload(HUM), {"tempo": "90"}, 422, "tempo", "tempo: not a field here"),
    ({"bpm": (None, "90")}, {}, 422, "audio", "audio: missing (the audio as a multipart file part named 'audio')"),
    ({"audio": (None, "text")}, {}, 422, "audio", "audio: must be a file part, not a text field"),
    # what the multipart parser would refuse for the whole body, named by its field
    ([("audio", ("a.wav", HUM, "audio/wav")), ("audio", ("b.wav", HUM, "audio/wav"))], {}, 422, "audio",
     "audio: given more than once"),
    ({**upload(HUM), "bpm": ("bpm.txt", b"90", "text/plain")}, {}, 422, "bpm", "bpm: must be a text field, not a file"),
    (upload(HUM), {"bpm": ["90", "100"]}, 422, "bpm", "bpm: given more than once"),
    (upload(HUM), {f"extra{n}": "1" for n in range(3)}, 422, "extra0", "extra0: not a field here"),
    (upload(HUM), {f"extra{n:02}": "1" for n in range(40)}, 422, "body",
     "body: the multipart form does not read: Too many fields"),
]


@pytest.mark.parametrize("route", ["/v1/transcriptions", "/v1/covers"])
@pytest.mark.parametrize("files,data,status,field,message", REFUSED)
def test_bad_audio_and_bad_fields_are_refused_naming_the_field_and_nothing_is_made(server, route, files, data,
                                                                                   status, field, message):
    song = {"style": "pop", "lyrics": LYRICS} if route == "/v1/covers" else {}
    answer = server.client.post(route, files=files, data={**song, **data}, timeout=300)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["field"], error["message"].startswith(message)) == (field, True), error
    assert server.client.get("/v1/songs").json()["songs"] == []
    assert not any((server.service.config.jobs).iterdir())


@pytest.mark.parametrize("content_type,body", [
    ("multipart/form-data", b"--x\r\nContent-Disposition: form-data; name=audio\r\n\r\n1\r\n--x--\r\n"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\n1\r\n--x--\r\n"),
    ("multipart/form-data; boundary=x", b"--y\r\nnot a part"),
])
def test_a_multipart_body_that_does_not_parse_is_a_422_naming_the_body(server, content_type, body):
    """No boundary, a part without a name, no part at all: one line naming `body` (the contract's 422, never
    Starlette's 400 with no field)."""
    for route in ("/v1/transcriptions", "/v1/covers"):
        answer = server.client.post(route, content=body, headers={"Content-Type": content_type})
        assert answer.status_code == 422 and answer.json()["error"]["field"] == "body", answer.text
        assert answer.json()["error"]["message"].startswith("body: the multipart form does not read: ")


def test_a_body_that_is_not_multipart_or_past_the_upload_limit_is_refused(server):
    client = server.client
    for route in ("/v1/transcriptions", "/v1/covers"):
        answer = client.post(route, json={"audio": "hum.wav"})
        assert answer.status_code == 415 and answer.json()["error"]["field"] == "Content-Type", answer.text
        big = upload(b"RIFF" + bytes(LIMIT))
        limit = f"audio: the upload is larger than the limit of 2 MB ({LIMIT} bytes; --max-upload-mb)"
        answer = client.post(route, files=big, data={"style": "pop", "lyrics": LYRICS})
        assert (answer.status_code, answer.json()["error"]) == (413, {"status": 413, "message": limit,
                                                                      "field": "audio"})
        request = client.build_request("POST", route, files=big)  # streamed: no Content-Length to go by
        body = request.read()

        def chunks():
            for start in range(0, len(body), 65536):
                yield body[start:start + 65536]

        answer = client.post(route, content=chunks(), headers={"Content-Type": request.headers["Content-Type"]})
        assert answer.status_code == 413 and answer.json()["error"]["message"] == limit, answer.text
    # the JSON routes keep their own limit
    assert client.post("/v1/scores/check", json={"abc": "x" * 300_000}).status_code == 413


def test_a_full_transcription_pool_answers_429_with_its_figures(server):
    """One transcription runs (--transcription-workers 1) and none may wait (--transcription-queue 0)."""
    long = wav_bytes(synthesize([(p + 16 * k, n, q) for k in range(6) for p, n, q in TWINKLE], 100, rate=8000), 8000)
    first = {}

    def run():
        first["answer"] = server.client.post("/v1/transcriptions", files=upload(long), timeout=300)

    caller = threading.Thread(target=run)
    caller.start()
    time.sleep(1.5)  # the long one is in the pool (its upload and the reading of its form take milliseconds)
    answer = server.client.post("/v1/transcriptions", files=upload(HUM))
    caller.join(300)
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "10", answer.text
    assert answer.json()["error"]["message"] == (
        "1 transcription is running and 0 waiting, the most this server keeps (--transcription-workers 1, "
        "--transcription-queue 0); retry later")
    assert first["answer"].status_code == 200


def test_a_cover_is_a_song_job_rendering_the_transcribed_score_and_keeping_its_record(server):
    client = server.client
    song = {"style": "pop, piano", "lyrics": LYRICS, "seed": "7", "id": "hummed", "bpm": "100"}
    answer = client.post("/v1/covers", files=upload(HUM), data=song, headers={"Idempotency-Key": "cover-1"},
                         timeout=300)
    assert answer.status_code == 202, answer.text
    created = answer.json()
    transcription = client.post("/v1/transcriptions", files=upload(HUM), data={"lyrics": LYRICS, "bpm": "100"},
                                timeout=300).json()
    assert created["transcription"] == transcription["transcription"] and created["label"] == "hummed"
    assert answer.headers["Location"] == created["urls"]["self"]
    doc = final(client, created["id"])
    assert doc["status"] == "complete", doc["error"]
    request = doc["request"]
    assert (request["style"], request["lyrics"], request["seed"], request["cot"], request["abc"]) == \
        ("pop, piano", LYRICS, 7, "melody", transcription["abc"])
    assert request["transcription"] == {**transcription["transcription"], "edited": False}
    assert doc["result"]["transcription"] == request["transcription"]
    assert client.get(created["urls"]["score"]).text == transcription["abc"]  # byte for byte
    kept = json.loads((server.service.directory(created["id"]) / "transcription.json").read_text())
    assert kept["request"]["bpm"] == 100 and len(kept["notes"]) == 14
    # the same key and upload again: the same job
    again = client.post("/v1/covers", files=upload(HUM), data=song, headers={"Idempotency-Key": "cover-1"},
                        timeout=300)
    assert again.status_code == 200 and again.json()["id"] == created["id"]
    # the score edited on a page and sent back with its record: the song says it is edited
    edited = transcription["abc"].replace("C4C4G4G4|", "C4C4G4A4|")
    body = {"style": "pop", "lyrics": LYRICS, "cot": "melody", "abc": edited,
            "transcription": transcription["transcription"], "stage": "plan"}
    answer = client.post("/v1/songs", json=body)
    assert answer.status_code == 202, answer.text
    assert final(client, answer.json()["id"])["request"]["transcription"]["edited"] is True


@pytest.mark.parametrize("change,message", [
    ({"abc": None, "transcription": record()}, "body: 'transcription' records where the score given as 'abc' came "
                                               "from; give abc too"),
    ({"transcription": record(notes=[])}, r"transcription: unknown field(s) ['notes']"),
    ({"transcription": {"transcriber": "pyin"}}, "transcription: missing"),
    ({"transcription": "pyin"}, "transcription must be an object"),
])
def test_a_songs_transcription_record_is_checked_naming_the_field(server, change, message):
    body = {"style": "pop", "lyrics": LYRICS, "cot": "melody", "abc": "X:1\n", **change}
    answer = server.client.post("/v1/songs", json={k: v for k, v in body.items() if v is not None})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "transcription", answer.text
    assert answer.json()["error"]["message"].startswith(message)


def test_a_transcribers_own_failure_is_a_documented_500_naming_it(pipe, tmp_path, monkeypatch):
    """SheetSage2's worker crashing without an answer (not a refusal of the audio, not a missing set-up): a 500 that
    says what failed, and the contract documents it."""
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\necho 'Traceback: boom' >&2; exit 3\n")
    crashing.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", str(crashing))  # the pool's process, spawned on the first call
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(tmp_path / "model"))
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1)))
    try:
        answer = server.client.post("/v1/transcriptions", files=upload(HUM), data={"transcriber": "sheetsage2"},
                                    timeout=300)
        assert answer.status_code == 500, answer.text
        assert answer.json()["error"]["message"].startswith(
            "the transcription failed: RuntimeError: sheetsage2's worker exited 3 without an answer"), answer.text
        paths = server.client.get("/openapi.json").json()["paths"]
        for route in ("/v1/transcriptions", "/v1/covers"):
            assert "transcriber failed" in paths[route]["post"]["responses"]["500"]["description"], route
    finally:
        server.stop()


def test_sheetsage2_is_told_the_gpu_memory_free_beside_the_engine(fake_gpu):
    from types import SimpleNamespace

    import torch

    from yue2_vllm.serve.routes.transcriptions import gpu_free_bytes

    gpu = fake_gpu("H100")
    on = SimpleNamespace(workers=SimpleNamespace(pipe=SimpleNamespace(device=torch.device("cuda", 0))))
    off = SimpleNamespace(workers=SimpleNamespace(pipe=SimpleNamespace(device=torch.device("cpu"))))
    replicas = SimpleNamespace(workers=SimpleNamespace())  # a Ray pool: the songs' GPUs are elsewhere
    assert (gpu_free_bytes(on), gpu_free_bytes(off), gpu_free_bytes(replicas)) == (gpu["free"], None, None)


# --------------------------------------------------------------------------- the limits, before the upload is read


class HeldUpload:
    """A request on its own socket that sent its headers and the first half of its multipart body and holds the rest
    back (a slow upload): `answer()` is what the server answers before the rest arrives."""

    def __init__(self, server, route: str, data: dict, headers: dict | None = None):
        import socket

        request = server.client.build_request("POST", route, files=upload(HUM), data=data, headers=headers)
        body = request.read()
        head = "".join(f"{name}: {value}\r\n" for name, value in request.headers.items())
        self.socket = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        self.socket.sendall(f"POST {route} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body[:len(body) // 2])

    def answer(self, timeout: float = 10) -> tuple[int, dict, dict]:
        import http.client
        import socket

        self.socket.settimeout(timeout)
        response = http.client.HTTPResponse(self.socket)
        try:
            response.begin()
        except socket.timeout:
            raise AssertionError(f"no answer within {timeout:g} s: the server waits for the whole upload") from None
        return response.status, dict(response.getheaders()), json.loads(response.read())

    def close(self) -> None:  # the client gives up: the server sees it disconnect mid-body
        self.socket.close()


def test_a_transcription_holds_its_place_in_the_pool_from_its_first_byte(server):
    """A slow upload holds the pool's only place (--transcription-workers 1, --transcription-queue 0): the next call
    is a 429 before its own upload is read; the place is given back when the slow one's client goes away."""
    holding = HeldUpload(server, "/v1/transcriptions", {})
    try:
        for route, data in (("/v1/transcriptions", {}), ("/v1/covers", {"style": "pop", "lyrics": LYRICS})):
            second = HeldUpload(server, route, data)
            try:
                status, headers, document = second.answer()
            finally:
                second.close()
            assert (status, headers["retry-after"]) == (429, "10"), document
            assert document["error"]["message"].startswith("1 transcription is running and 0 waiting")
    finally:
        holding.close()
    answer = wait_for(lambda: server.client.post("/v1/transcriptions", files=upload(HUM), data={"bpm": "500"}),
                      lambda answer: answer.status_code != 429, 30)
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "bpm", answer.text


def test_a_covers_idempotency_key_is_held_from_its_first_byte(server):
    """A cover whose upload (then transcription) is under way holds its Idempotency-Key: a retry with the key is a
    409 before its upload is read (never a second transcription); once the first request ends, failed or not, the
    key is free."""
    song = {"style": "pop", "lyrics": LYRICS}
    holding = HeldUpload(server, "/v1/covers", song, {"Idempotency-Key": "held-1"})
    try:
        retry = HeldUpload(server, "/v1/covers", song, {"Idempotency-Key": "held-1"})
        try:
            status, headers, document = retry.answer()
        finally:
            retry.close()
        assert (status, headers["retry-after"], document["error"]["field"]) == (409, "1", "Idempotency-Key"), document
    finally:
        holding.close()
    answer = wait_for(lambda: server.client.post("/v1/covers", files=upload(HUM), data={**song, "bpm": "500"},
                                                 headers={"Idempotency-Key": "held-1"}),
                      lambda answer: answer.status_code not in (409, 429), 30)
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "bpm", answer.text
