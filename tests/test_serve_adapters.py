"""Adapters over HTTP: GET /v1/adapters and /v1/models, songs that name adapters, OpenAI's speech endpoint driven by
the official `openai` client, and every refusal naming its field."""
import io
import json

import numpy as np
import pytest
import soundfile

from serving import GENERATION, ThreadServer, wait_for
from yue2_vllm.options import AdapterOptions
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.testing_adapters import write_tiny_adapter

LYRICS = "[verse]\nla la la\n"


@pytest.fixture(scope="module")
def adapted(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    from yue2_vllm.pipeline import YuE2Pipeline

    root = tmp_path_factory.mktemp("adapters")
    (root / "inst").mkdir()
    (root / "inst" / "README.md").write_text("---\nlicense: cc-by-nc-4.0\n---\n# an instrumental adapter\n")
    write_tiny_adapter(root / "inst" / "ar_lora_inst.safetensors", "plain", rank=8, gain=2.0)
    write_tiny_adapter(root / "voice.safetensors", "comfyui", half="nar")
    options = AdapterOptions((("inst", str(root / "inst")), ("voice", str(root / "voice.safetensors"))),
                             cache_dir=root / "cache")
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, adapters=options) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def server(adapted, tmp_path_factory):
    server = ThreadServer(SongService(adapted, ServeConfig(tmp_path_factory.mktemp("data"))))
    yield server
    server.stop()


def finished(server, job_id):
    return wait_for(lambda: server.client.get(f"/v1/songs/{job_id}").json(),
                    lambda doc: doc["status"] in ("complete", "failed", "cancelled"))


def test_the_adapters_are_listed(server):
    listing = server.client.get("/v1/adapters").json()["adapters"]
    assert [a["name"] for a in listing] == ["inst", "voice"]
    inst, voice = listing
    assert (inst["half"], inst["rank"], inst["layout"], inst["licence"]) == ("ar", 8, "plain", "cc-by-nc-4.0")
    assert (voice["half"], voice["layout"]) == ("nar", "comfyui") and "vae2llm" in voice["modules"]
    assert len(inst["sha256"]) == 64 and "self_attn.q_proj" in inst["modules"]
    models = server.client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("yue2", None), ("inst", "yue2"), ("voice", "yue2")]


def test_a_song_with_adapters_records_them(server):
    body = {"style": "pop", "lyrics": LYRICS, "seed": 3, "adapters": [{"name": "inst", "scale": 0.5},
                                                                      {"name": "voice"}]}
    job = server.client.post("/v1/songs", json=body).json()["id"]
    plain = server.client.post("/v1/songs", json={"style": "pop", "lyrics": LYRICS, "seed": 3}).json()["id"]
    assert finished(server, job)["status"] == "complete" and finished(server, plain)["status"] == "complete"
    result = server.client.get(f"/v1/songs/{job}/result").json()
    assert [(a["name"], a["scale"], a["half"]) for a in result["adapters"]] == [("inst", 0.5, "ar"),
                                                                                ("voice", 1.0, "nar")]
    base = server.client.get(f"/v1/songs/{plain}/result").json()
    assert "adapters" not in base and base["identity"] != result["identity"]


def test_a_posted_songs_adapters_are_resolved_once(server, adapted, monkeypatch):
    """The POST's admission checks the names against the listing; the song's admission on the worker looks each
    adapter up once, and every stage, result.json and the verification of the finished song read what it carries."""
    registry = adapted.adapters.registry
    looked_up, real = [], registry.get
    monkeypatch.setattr(registry, "get", lambda name: looked_up.append(name) or real(name))
    body = {"style": "pop", "lyrics": LYRICS, "seed": 4, "adapters": [{"name": "inst", "scale": 0.5},
                                                                      {"name": "voice"}]}
    job = server.client.post("/v1/songs", json=body).json()["id"]
    assert finished(server, job)["status"] == "complete"
    assert looked_up == ["inst", "voice"]


@pytest.mark.parametrize("adapters, message", [
    ([{"name": "nope"}], "adapters[0]: unknown adapter 'nope' (registered: inst, voice)"),
    ([{"name": "inst", "scale": 11}], "scale"),
    ([{"name": "inst", "weight": 1}], "unknown field"),
    ("inst", "must be a list"),
])
@pytest.mark.parametrize("path", ["/v1/songs", "/v1/songs/length"])
def test_bad_adapter_choices_are_named(server, adapters, message, path):
    answer = server.client.post(path, json={"style": "pop", "lyrics": LYRICS, "adapters": adapters})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == "adapters" and message in error["message"], error


def test_the_openapi_document_knows_the_adapters(server):
    schema = server.client.get("/openapi.json").json()
    assert {"/v1/adapters", "/v1/models", "/v1/audio/speech"} <= set(schema["paths"])
    choice = schema["components"]["schemas"]["AdapterChoice"]
    assert choice["properties"]["name"]["enum"] == ["inst", "voice"]


def test_openais_client_makes_songs(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    wav = client.audio.speech.create(model="inst", voice="alloy", input=LYRICS, instructions="pop, piano",
                                     response_format="wav")
    audio, rate = soundfile.read(io.BytesIO(wav.content))
    assert rate == 48000 and audio.shape[1] == 2 and np.isfinite(audio).all() and len(audio) > 0
    flac = client.audio.speech.create(model="yue2", voice="song_one", input=LYRICS, instructions="rock")
    assert flac.response.headers["content-type"] == "audio/flac"
    job = flac.response.headers["x-song-id"]
    assert server.client.get(f"/v1/songs/{job}").json()["label"] == "song_one"
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o-mini-tts' does not exist"):
        client.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=LYRICS, instructions="pop")
    with pytest.raises(openai.UnprocessableEntityError, match="response_format"):
        client.audio.speech.create(model="yue2", voice="alloy", input=LYRICS, instructions="pop",
                                   response_format="mp3")
    with pytest.raises(openai.UnprocessableEntityError, match="instructions"):
        client.audio.speech.create(model="yue2", voice="alloy", input=LYRICS)
    with pytest.raises(openai.UnprocessableEntityError, match="speed"):
        client.audio.speech.create(model="yue2", voice="alloy", input=LYRICS, instructions="pop", speed=1.5)


def test_a_speech_song_past_its_wait_is_a_504_naming_the_job_which_goes_on(adapted, tmp_path):
    server = ThreadServer(SongService(adapted, ServeConfig(tmp_path / "data", speech_wait_seconds=1e-6)))
    try:
        answer = server.client.post("/v1/audio/speech", json={"model": "yue2", "voice": "alloy", "input": LYRICS,
                                                               "instructions": "pop"})
        job = answer.headers["x-song-id"]
        assert (answer.status_code, answer.headers["location"]) == (504, f"/v1/songs/{job}")
        assert answer.json()["error"]["message"].startswith(f"the song {job} is still queued after 1e-06 s "
                                                            "(--speech-timeout); it goes on as a job")
        assert finished(server, job)["status"] == "complete"
        audio, rate = soundfile.read(io.BytesIO(server.client.get(f"/v1/songs/{job}/audio").content))
        assert rate == 48000 and len(audio) > 0
    finally:
        server.stop()


def test_a_speech_body_that_is_not_json(server):
    answer = server.client.post("/v1/audio/speech", content=b"{", headers={"content-type": "application/json"})
    assert answer.status_code == 422 and answer.json()["error"]["message"].startswith("body: invalid JSON")
    answer = server.client.post("/v1/audio/speech", content=json.dumps([1]), headers={"content-type":
                                                                                       "application/json"})
    assert answer.status_code == 422


def test_the_page_picks_adapters_and_scales(server):
    from pathlib import Path

    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (CI does)")
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("apt-get install chromium (CI does)")
    problems = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--headless", "--no-sandbox",
                                                                                   "--disable-gpu"])
        page = browser.new_page()
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(server.url + "/")
        page.locator("#adapters-box").wait_for(state="visible")
        assert page.locator("[data-adapter]").count() == 2
        assert "cc-by-nc-4.0" in page.inner_text("#adapters-list")
        left = {page.locator(f"#adapter-scale-{name}").bounding_box()["x"] for name in ("inst", "voice")}
        assert len(left) == 1  # the scales line up
        page.fill("#style", "pop")
        page.fill("#lyrics", LYRICS)
        page.check("#adapter-inst")
        page.fill("#adapter-scale-inst", "0.25")
        with page.expect_response(lambda response: response.url.endswith("/v1/songs")
                                  and response.request.method == "POST") as answer:
            page.click("#submit")
        job = answer.value.json()["id"]
        wait_for(lambda: page.inner_text("#current-meta"), lambda text: "adapters inst ×0.25" in text, timeout=30)
        browser.close()
    assert not problems, problems
    assert server.client.get(f"/v1/songs/{job}").json()["request"]["adapters"] == [{"name": "inst", "scale": 0.25}]
    assert finished(server, job)["status"] == "complete"
