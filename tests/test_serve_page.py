"""The web page in a real browser: headless Debian chromium driven by Playwright, against `yue2-vllm serve` with no
model flags (the embedded tiny default, the vLLM engine when installed).

The screenshot is kept in the test's tmp dir; with YUE2_UPDATE_SCREENSHOT=1 it also replaces docs/serve-page.png
(docs/serving.md's picture), so a plain test run leaves the checkout as it was.
"""
import contextlib
import io
import os
import shutil
import time
from pathlib import Path

import pytest

from serving import ProcessServer, wait_for

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "serve-page.png"
DOCS_SCORE_SCREENSHOT = DOCS_SCREENSHOT.with_name("serve-score.png")
KEY = "page-test-key-0123456789"
# Line separators a JSON encoder leaves raw (U+2028, U+2029, NEL): the event stream must still carry them.
LYRICS = "[verse]\nla la\u2028la\u2029la\u0085la\n[chorus]\nhey\n"

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (CI does)")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="apt-get install chromium (CI does)")


def drawn(png: bytes) -> tuple[float, int]:
    """A screenshot's share of pixels unlike its most common colour (the background), and how many colours."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = sorted(image.getcolors(maxcolors=1 << 24), reverse=True)
    total = sum(count for count, _ in counts)
    return 1 - counts[0][0] / total, len(counts)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    """One server for the module's tests (the engine starts once)."""
    from yue2_vllm.testing import TINY_VERSION

    tmp_path = tmp_path_factory.mktemp("page")

    cache = tmp_path / "cache" / TINY_VERSION  # what tiny_default() makes, already made
    cache.mkdir(parents=True)
    (cache / "YuE2-3B-tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    (cache / "YuE2-Vae-tiny").symlink_to(tiny_vae_dir, target_is_directory=True)
    server = ProcessServer(["--data-dir", str(tmp_path / "data"), "--quiet", "--api-key", KEY],
                           env={"YUE2_VLLM_CACHE": str(tmp_path / "cache")}, log=tmp_path / "serve.log")
    try:
        server.wait_healthy()
        server.client.headers["Authorization"] = f"Bearer {KEY}"
        yield server
    finally:
        assert server.stop() == 0


@contextlib.contextmanager
def keyed_page(server, problems: list):
    """A fresh chromium page on the server's page with the API key entered; its page errors go to `problems`."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(server.url + "/")
        page.locator("#health.ok").wait_for()
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        yield page
        browser.close()


def test_make_a_song_with_the_form_and_hear_it(server, tmp_path):
    requests, problems = [], []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("request", lambda request: requests.append(request.url))
        ranges = []  # the player's requests for the audio: (url, its Range header)
        page.on("request", lambda request: "/audio?" in request.url
                and ranges.append((request.url, request.headers.get("range"))))
        statuses = []
        page.on("response", lambda response: statuses.append((response.status, response.url)))
        page.on("console", lambda message: message.type == "error" and problems.append(message.text))
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(server.url + "/")
        assert page.title().startswith("yue2-vllm")
        page.locator("#health.ok").wait_for()
        page.locator("#jobs-error").wait_for(state="visible")  # the key is asked for, not a 401 fetched
        assert "API key" in page.inner_text("#jobs-error") and page.locator("#api-key").is_visible()
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.locator("#jobs-empty").wait_for(state="visible")
        assert not [s for s in statuses if s[0] == 401], statuses

        page.fill("#semantic-max_tokens", "3")  # under the phase's min_tokens: explained on the field
        page.focus("#lyrics")
        page.keyboard.press("Control+Enter")
        alert = page.locator("#form-error")
        alert.wait_for(state="visible")
        assert "min tokens" in alert.inner_text(), alert.inner_text()
        assert page.get_attribute("#semantic-max_tokens", "aria-invalid") == "true"
        assert page.evaluate("document.activeElement.id") == "semantic-max_tokens"
        page.fill("#semantic-max_tokens", "")

        page.fill("#cfg_scale", "99")  # an honest error: the server's 422 message, on the field it names
        page.focus("#lyrics")
        page.keyboard.press("Control+Enter")
        alert = page.locator("#form-error")
        alert.wait_for(state="visible")
        assert alert.inner_text() == "422: cfg_scale must be a finite number in [0, 20], got 99"
        assert page.get_attribute("#cfg_scale", "aria-invalid") == "true"
        assert page.evaluate("document.activeElement.id") == "cfg_scale"

        page.fill("#cfg_scale", "")
        page.fill("#style", "pop, piano, warm female vocal")
        page.fill("#lyrics", LYRICS)
        page.keyboard.press("Control+Enter")
        page.locator("#current").wait_for(state="visible")
        job_id = page.evaluate("location.hash").lstrip("#")
        page.locator("#player").wait_for(state="visible", timeout=300_000)
        duration = wait_for(lambda: page.evaluate("document.getElementById('audio').duration"),
                            lambda value: value and value > 0, timeout=30)
        doc = server.client.get(f"/v1/songs/{job_id}").json()
        assert doc["status"] == "complete" and doc["request"]["style"] == "pop, piano, warm female vocal"
        assert doc["request"]["lyrics"] == LYRICS
        assert abs(duration - doc["result"]["audio_seconds"]) < 0.05, (duration, doc["result"])
        assert page.inner_text("#current-status") == "complete"
        assert page.inner_text("#score") == server.client.get(f"/v1/songs/{job_id}/score").text
        signed = page.get_attribute("#download", "href")  # a signed URL: the key stays in the page
        assert signed.startswith(f"/v1/songs/{job_id}/audio?expires=") and "signature=" in signed
        assert page.evaluate("document.getElementById('audio').src") == server.url + signed
        result_href = page.get_attribute("#result-link", "href")
        assert result_href.startswith("blob:")
        result = page.evaluate("(url) => fetch(url).then((r) => r.json())", result_href)
        assert result["audio_seconds"] == doc["result"]["audio_seconds"]
        assert [p.get_attribute("value") for p in page.locator("#bars progress").all()] == ["1"] * 4
        row = page.locator(f"#jobs tr[data-id='{job_id}']")
        row.wait_for()
        assert "complete" in row.inner_text()
        page.locator("#jobs-empty").wait_for(state="hidden")
        # The song's picture, from the server's peaks answer (asked once): both channels' peaks, a spectrogram.
        page.locator("#picture").wait_for(state="visible", timeout=30_000)
        page.wait_for_function("document.getElementById('spectrogram').width === 720 && "
                               "!document.getElementById('spectrogram').hidden", timeout=30_000)
        assert [url for url in requests if "/peaks" in url] == [f"{server.url}/v1/songs/{job_id}/peaks"]
        # The player streams: it asks for the audio itself, by Range, at the signed URL (never a fetch of it all).
        assert [url for url in requests if "/audio" in url and "/audio?" not in url] == [
            f"{server.url}/v1/songs/{job_id}/audio-url"]
        assert ranges and all(url == server.url + signed and rng and rng.startswith("bytes=")
                              for url, rng in ranges), ranges
        for lane in ("#waveform", "#spectrogram"):
            share, colours = drawn(page.locator(lane).screenshot())
            assert share > 0.02 and colours > 8, (lane, share, colours)
        box = page.locator("#picture").bounding_box()
        assert page.evaluate("document.getElementById('audio').currentTime") == 0
        page.locator("#picture").click(position={"x": box["width"] * 0.6, "y": box["height"] / 2})
        seconds = page.evaluate("document.getElementById('audio').currentTime")
        assert abs(seconds - 0.6 * duration) < 0.02 * duration, (seconds, duration)
        played = page.evaluate("document.getElementById('played').getBoundingClientRect().width")
        assert abs(played - 0.6 * box["width"]) < 4, (played, box)
        page.focus("#picture")
        page.keyboard.press("Home")  # and from the keyboard
        assert page.evaluate("document.getElementById('audio').currentTime") == 0
        page.locator("#picture").click(position={"x": box["width"] * 0.6, "y": box["height"] / 2})
        page.evaluate("document.activeElement.blur()")
        time.sleep(0.5)  # let the bars' transitions settle for the picture
        screenshot = tmp_path / "serve-page.png"
        page.screenshot(path=str(screenshot), full_page=True)

        # Delete (once confirmed): the song is gone from the page and from the server.
        dialogs = []
        page.once("dialog", lambda dialog: dialogs.append(dialog.message) or dialog.dismiss())
        row.locator("button", has_text="Delete").click()
        wait_for(lambda: dialogs, lambda seen: seen, timeout=10)
        assert job_id in dialogs[0] and server.client.get(f"/v1/songs/{job_id}").status_code == 200
        page.once("dialog", lambda dialog: dialog.accept())
        row.locator("button", has_text="Delete").click()
        row.wait_for(state="detached")
        page.locator("#current").wait_for(state="hidden")
        assert server.client.get(f"/v1/songs/{job_id}").status_code == 404
        browser.close()
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("YUE2_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(screenshot, DOCS_SCREENSHOT)
    ours = (server.url, f"blob:{server.url}/")  # the server, and blobs of what the page fetched from it with the key
    assert all(url.startswith(ours) for url in requests), [u for u in requests if not u.startswith(ours)]
    assert not [p for p in problems if "status of 422" not in p], problems
    assert not [s for s in statuses if s[0] == 401], statuses


def test_a_stale_download_never_lands_under_another_song(server):
    """Open song A, then B while A's audio URL (then A's peaks) are still on their way: B's view keeps B's."""
    client = server.client
    jobs = {}
    for name, frames in (("a", 12), ("b", 30)):  # songs of different lengths: their pictures differ
        job = client.post("/v1/songs", json={"style": "pop", "lyrics": f"[verse]\n{name}\n",
                                             "semantic_sampling": {"min_tokens": frames, "max_tokens": frames}})
        assert job.status_code == 202, job.text
        jobs[name] = job.json()["id"]
    docs = {name: wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(), lambda d: d["status"] == "complete",
                           300) for name, job_id in jobs.items()}
    a, b = jobs["a"], jobs["b"]
    problems = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.add_init_script(f"sessionStorage.setItem('yue2-api-key', {KEY!r})")
        page.goto(server.url + "/")
        page.locator(f"#jobs tr[data-id='{b}']").wait_for()

        def shows_b():
            wait_for(lambda: page.evaluate("[document.getElementById('picture').dataset.song, "
                                           "document.getElementById('picture').hidden]"),
                     lambda shown: shown == [b, False], timeout=30)
            wait_for(lambda: page.evaluate("document.getElementById('audio').duration"),
                     lambda value: value and abs(value - docs["b"]["result"]["audio_seconds"]) < 0.05, timeout=30)

        for held_path in ("audio-url", "peaks"):
            held = []
            pattern = f"**/v1/songs/{a}/{held_path}"
            page.route(pattern, lambda route: held.append(route))  # A's answer waits until released below
            page.click(f"#jobs tr[data-id='{a}'] [data-open]")
            wait_for(lambda: page.wait_for_timeout(50) or held, lambda seen: seen, timeout=30)  # events need a call
            page.click(f"#jobs tr[data-id='{b}'] [data-open]")
            shows_b()
            held[0].continue_()  # A's late answer arrives while B is shown
            page.wait_for_timeout(1000)
            page.unroute(pattern)
            assert page.evaluate("location.hash") == f"#{b}"
            assert page.evaluate("document.getElementById('audio').dataset.song") == b
            assert f"/v1/songs/{b}/audio?" in page.evaluate("document.getElementById('audio').src")
            assert f"/v1/songs/{b}/audio?" in page.get_attribute("#download", "href")
            assert page.evaluate("document.getElementById('picture').dataset.song") == b
            assert page.evaluate("current.picture.duration") == docs["b"]["result"]["audio_seconds"]
            assert abs(page.evaluate("document.getElementById('audio').duration")
                       - docs["b"]["result"]["audio_seconds"]) < 0.05
        browser.close()
    assert not problems, problems


def test_takes_side_by_side_keep_one_and_delete_another(server, tmp_path):
    problems = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda message: message.type == "error" and problems.append(message.text))
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(server.url + "/")
        page.locator("#health.ok").wait_for()
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.fill("#seed", "40")
        page.fill("#takes", "9")  # over the limit: the server's 422, on the field
        page.focus("#lyrics")
        page.keyboard.press("Control+Enter")
        page.locator("#form-error").wait_for(state="visible")
        assert "takes" in page.inner_text("#form-error") and page.get_attribute("#takes", "aria-invalid") == "true"
        page.fill("#takes", "3")
        page.keyboard.press("Control+Enter")
        page.locator("#takes-box").wait_for(state="visible", timeout=60_000)
        job_id = page.evaluate("location.hash").lstrip("#")
        cards = page.locator("#takes-list .take")
        wait_for(lambda: [c.locator(".badge").inner_text() for c in cards.all()],
                 lambda badges: badges == ["complete"] * 3, timeout=300)
        doc = server.client.get(f"/v1/songs/{job_id}").json()
        assert [e["seed"] for e in doc["takes"]["entries"]] == [40, 41, 42] and doc["takes"]["best_of"] is True
        for card, entry in zip(cards.all(), doc["takes"]["entries"]):
            text = card.inner_text()
            assert f"Take {entry['take']}" in text and f"seed {entry['seed']}" in text
            assert f"log-prob {entry['signals']['semantic_mean_logprob']:.3f}" in text
            assert ("★" in text) == (entry["take"] == doc["takes"]["pick"])
        # each take's player and waveform, from its own FLAC
        wait_for(lambda: page.evaluate("[...document.querySelectorAll('#takes-list audio')].map((a) => a.duration)"),
                 lambda durations: len(durations) == 3 and all(d and d > 0 for d in durations), timeout=60)
        wait_for(lambda: [drawn(c.locator("canvas").screenshot())[0] for c in cards.all()],
                 lambda shares: all(share > 0.02 for share in shares), timeout=30)
        page.locator("[aria-label='Keep take 2']").click()
        page.locator("#takes-list .take.kept[data-take='2']").wait_for()
        assert server.client.get(f"/v1/songs/{job_id}").json()["takes"]["kept"] == 2
        assert page.locator("[aria-label='Delete take 1']").is_hidden()  # take 1 is the job itself
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator("[aria-label='Delete take 3']").click()
        page.locator("#takes-list .take[data-take='3']").wait_for(state="detached")
        assert server.client.get(f"/v1/songs/{job_id}/takes/3").status_code == 404
        assert [e["status"] for e in server.client.get(f"/v1/songs/{job_id}").json()["takes"]["entries"]] == \
            ["complete", "complete", "deleted"]
        browser.close()
    assert not [p for p in problems if "status of 422" not in p], problems


def test_an_instrumental_from_the_form_plans_the_edited_score_without_lyrics(server):
    from test_instrumental import EDITED, SCORE

    problems = []
    with keyed_page(server, problems) as page:
        page.check("#instrumental")  # lyrics become optional
        assert page.evaluate("document.getElementById('lyrics').required") is False
        page.fill("#lyrics", "")
        page.evaluate("document.getElementById('advanced').open = true")
        page.fill("#abc", "X:1\nT:\nK:C\n")  # not a native score: the 422 names the line, on the field
        page.check("#plan-only")
        page.focus("#style")
        page.keyboard.press("Control+Enter")
        page.locator("#form-error").wait_for(state="visible")
        assert page.inner_text("#form-error").startswith("422: abc: score line 3:")
        assert page.get_attribute("#abc", "aria-invalid") == "true"
        page.fill("#abc", SCORE)
        page.keyboard.press("Control+Enter")
        page.locator("#current").wait_for(state="visible")
        job_id = page.evaluate("location.hash").lstrip("#")
        doc = wait_for(lambda: server.client.get(f"/v1/songs/{job_id}").json(),
                       lambda d: d["status"] in ("complete", "failed", "cancelled"), timeout=120)
        assert doc["status"] == "complete" and doc["request"]["instrumental"] is True
        assert doc["request"]["lyrics"] == ""
        assert server.client.get(f"/v1/songs/{job_id}/score").text == EDITED
    assert not problems, problems


def test_a_length_from_the_form_and_the_continue_button(server):
    """The form's length caps the song (the hint under it says the longest song the request can reach, and a length
    the server would refuse, as you type); a capped song's Continue makes the longer song as a new job."""
    problems = []
    with keyed_page(server, problems) as page:
        page.fill("#seconds", "2")  # the tiny model's songs have at least 200 tokens: 8 s
        wait_for(lambda: page.inner_text("#longest"), lambda text: "below the semantic phase's min_tokens 200" in text,
                 timeout=30)
        page.fill("#seconds", "8")
        wait_for(lambda: page.inner_text("#longest"),
                 lambda text: text.startswith("The longest song this request can reach: 16 min"), timeout=30)
        page.focus("#style")
        page.keyboard.press("Control+Enter")
        page.locator("#current").wait_for(state="visible")
        capped = page.evaluate("location.hash").lstrip("#")
        page.locator("#continue-box").wait_for(state="visible", timeout=300_000)
        doc = server.client.get(f"/v1/songs/{capped}").json()
        assert doc["request"]["seconds"] == 8 and doc["result"]["truncation"]["semantic"]["tokens"] == 200
        assert "capped at 8.0 s (its length)" in page.inner_text("#current-meta")
        page.fill("#continue-seconds", "9")
        page.click("#continue")
        wait_for(lambda: page.evaluate("location.hash").lstrip("#"), lambda shown: shown != capped, timeout=30)
        job_id = page.evaluate("location.hash").lstrip("#")
        doc = wait_for(lambda: server.client.get(f"/v1/songs/{job_id}").json(),
                       lambda d: d["status"] in ("complete", "failed", "cancelled"), timeout=300)
        assert doc["status"] == "complete" and doc["continued_from"] == {"id": capped, "take": 1}
        assert doc["result"]["audio_seconds"] == (225 * 1920 - 64) / 48000
        wait_for(lambda: page.inner_text("#current-meta"), lambda text: f"continues {capped}" in text, timeout=30)
    assert not problems, problems


BIG_SEED = 2 ** 53 + 1  # a JSON number past 2**53 loses digits: the page sends the seed as the server wrote it


def finished(client, job_id, timeout=300) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                    lambda d: d["status"] in ("complete", "failed", "cancelled"), timeout=timeout)


def downloaded(page, button) -> tuple[str, bytes]:
    """What clicking `button` saves: its file name and bytes."""
    with page.expect_download() as download:
        page.click(button)
    return download.value.suggested_filename, Path(download.value.path()).read_bytes()


def shown(page, selector: str, problems: list, timeout: float = 60_000) -> None:
    """Wait for `selector` to show; if it does not, fail with the page's errors (an exception in a click's handler
    would otherwise only be seen after the wait)."""
    try:
        page.locator(selector).wait_for(state="visible", timeout=timeout)
    except sync_api.TimeoutError:
        raise AssertionError(f"{selector} is not shown; the page's errors: {problems}; it shows "
                             f"{page.evaluate('location.hash')!r}: {page.inner_text('main')[-2000:]!r}") from None


def open_listed(page, job_id: str) -> None:
    """Open a song from the recent songs list, as a user does: click its Open and see its id in the address. A fresh
    page's list is redrawn as it loads (the key entered, the 4 s refresh); once in CI under load a click then left
    the page with no song and no error, so a click the page did not take within 15 s is made again, once."""
    for attempt in range(2):
        page.click(f"#jobs tr[data-id='{job_id}'] [data-open]")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # polled: the page's CSP has no 'unsafe-eval' for wait_for_function
            if page.evaluate("location.hash") == f"#{job_id}":
                return
            page.wait_for_timeout(50)
    raise AssertionError(f"Open of {job_id} was not taken twice; the list shows {page.inner_text('#jobs')!r}")


def test_the_score_as_music_drawn_played_checked_edited_rendered_and_downloaded(server, tmp_path):
    """A song's score (given, so it reads as the dialect): its notation of both voices drawn by the vendored abcjs,
    played by the page's synth (WebAudio oscillators), the ABC edited with the server's verdict as you type, an
    error's one line naming the score line, the fixed edit (its chords removed) rendered as a new song with the
    same seed in cot melody, and the downloads the server's files."""
    from test_instrumental import SCORE
    from yue2_vllm.score_notes import check_score

    fast = SCORE.replace("Q:1/4=100", "Q:1/4=300")  # 16 quarters: 3.2 s of music
    client = server.client
    song = {"style": "pop, piano", "lyrics": "[verse]\nla la\n", "cot": "full", "seed": BIG_SEED}
    response = client.post("/v1/songs", json={**song, "abc": fast, "stage": "plan", "id": "sketch"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert finished(client, job_id)["status"] == "complete"
    problems = []
    with keyed_page(server, problems) as page:
        page.on("console", lambda message: message.type == "error" and problems.append(message.text))
        open_listed(page, job_id)
        shown(page, "#notation svg", problems)
        # both voices drawn: every written note head (the tied d is two), and the chord symbols over Vocal
        notes = "document.querySelectorAll('#notation .abcjs-note.abcjs-v{}').length"
        assert (page.evaluate(notes.format(0)), page.evaluate(notes.format(1))) == (5, 7)
        assert page.evaluate("[...document.querySelectorAll('#notation .abcjs-chord')].map((c) => c.textContent)") \
            == ["G", "G", "C"]
        assert page.inner_text("#score-check") == "Reads as YuE2's score: it renders with cot full (it has chord " \
                                                  "symbols)."
        assert page.inner_text("#score-facts") == "4/4 · K:G · ♩ = 300 · 4 bars · 0:03 · 4 Vocal and 7 Ins notes · " \
                                                  "3 chord symbols"
        assert page.is_hidden("#score")

        # Play: an oscillator a note (4 Vocal, 7 Ins, 3 chords of 4 tones), on a running AudioContext, to the end
        page.click("#score-play")
        state = ("[scoreSynth.context.state, scoreSynth.started.Vocal, scoreSynth.started.Ins, "
                 "scoreSynth.started.Chords]")
        wait_for(lambda: page.evaluate(state), lambda value: value == ["running", 4, 7, 12], timeout=30)
        wait_for(lambda: page.inner_text("#score-play"), lambda text: text == "▶ Play", timeout=30)  # over by itself
        assert page.evaluate("scoreSynth.context.currentTime") > 3.2 and page.evaluate("scoreSynth.run") is None
        time.sleep(0.3)
        shot = tmp_path / "serve-score.png"
        page.locator("#score-card").screenshot(path=str(shot))

        # the song's files, as the server has them (with the key: fetched, then saved)
        assert downloaded(page, "#score-abc") == ("sketch.abc", client.get(f"/v1/songs/{job_id}/score").content)
        assert downloaded(page, "#score-midi") == ("sketch.mid", client.get(f"/v1/songs/{job_id}/score.mid").content)

        # an edit with an error: the reader's one line naming the score line, the notation faded, no render
        page.click("#score-editor summary")
        broken = fast.replace("B8d8g16|", "B8d8g8|")
        page.fill("#score-text", broken)
        wait_for(lambda: page.inner_text("#score-check"), lambda text: text.startswith("score line"), timeout=30)
        assert page.inner_text("#score-check") == check_score(broken)["problem"] == (
            "score line 13: group 1, Ins, bar 1: the bar holds 3 quarter notes, its meter 4/4 takes 4")
        assert page.get_attribute("#score-text", "aria-invalid") == "true"
        assert page.is_disabled("#score-render") and "stale" in page.get_attribute("#notation", "class")
        page.click("#score-check")  # selects the line it names
        assert page.evaluate("(() => { const area = document.getElementById('score-text'); "
                             "return area.value.slice(area.selectionStart, area.selectionEnd); })()") == "B8d8g8|e32|"

        # the fixed edit without its chord symbols: it reads, and renders in melody (upstream's rule)
        edited = fast.replace('"G"', "").replace('"C"', "")
        page.fill("#score-text", edited)
        melody = "Reads as YuE2's score: it renders with cot melody (no chord symbols)."
        wait_for(lambda: page.inner_text("#score-check"), lambda text: text == melody, timeout=30)
        wait_for(lambda: page.get_attribute("#notation", "class"), lambda names: "stale" not in names, timeout=30)
        assert page.evaluate("document.querySelectorAll('#notation .abcjs-chord').length") == 0
        assert page.inner_text("#score-render-hint") == \
            f"Makes a new song with this song's seed {BIG_SEED}, style and lyrics, cot melody."
        assert downloaded(page, "#edit-abc") == ("sketch.edit.abc", edited.encode())
        assert downloaded(page, "#edit-midi") == ("sketch.edit.mid",
                                                  client.post("/v1/scores/midi", json={"abc": edited}).content)
        page.click("#score-render")
        wait_for(lambda: page.evaluate("location.hash"), lambda shown: shown not in ("", f"#{job_id}"), timeout=30)
        new_id = page.evaluate("location.hash").lstrip("#")
        doc = finished(client, new_id)
        assert doc["status"] == "complete" and doc["stage"] == "audio", doc["error"]
        assert doc["request"] == {**song, "abc": edited, "cot": "melody", "cfg_scale": None}
        assert client.get(f"/v1/songs/{new_id}/score").text == edited
        wait_for(lambda: page.inner_text("#score-check"), lambda text: "cot melody" in text, timeout=30)
        assert page.input_value("#score-text") == edited and page.is_disabled("#score-revert")
    assert not problems, problems
    assert shot.stat().st_size > 10_000
    if os.environ.get("YUE2_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, DOCS_SCORE_SCREENSHOT)


def test_a_score_that_does_not_read_is_its_text_and_the_readers_line(server):
    """The tiny model writes random text for its score: the panel shows it as it is with the reader's one line (no
    notation, nothing to play, no MIDI); a song with cot off has no score, and no panel."""
    from yue2_vllm.score_notes import check_score

    client = server.client
    jobs = {}
    for cot in ("full", "off"):
        response = client.post("/v1/songs", json={"style": "pop", "lyrics": "[verse]\nla\n", "cot": cot,
                                                  "stage": "plan"})
        assert response.status_code == 202, response.text
        jobs[cot] = response.json()["id"]
        assert finished(client, jobs[cot])["status"] == "complete"
    text = client.get(f"/v1/songs/{jobs['full']}/score").text
    problems = []
    with keyed_page(server, problems) as page:
        page.on("console", lambda message: message.type == "error" and problems.append(message.text))
        open_listed(page, jobs["full"])
        shown(page, "#score", problems)
        assert page.inner_text("#score") == text
        wait_for(lambda: page.inner_text("#score-check"), lambda line: line.startswith("score line"), timeout=30)
        assert page.inner_text("#score-check") == check_score(text)["problem"]
        assert page.is_hidden("#notation") and page.is_disabled("#score-play") and page.is_hidden("#score-midi")
        assert page.evaluate("document.querySelectorAll('#notation svg').length") == 0
        assert page.is_visible("#score-abc")  # the text as the song wrote it still downloads
        page.click(f"#jobs tr[data-id='{jobs['off']}'] [data-open]")
        wait_for(lambda: page.evaluate("location.hash"), lambda shown: shown == f"#{jobs['off']}", timeout=30)
        page.locator("#current-status").wait_for()
        page.wait_for_timeout(500)
        assert page.is_hidden("#score-card")
    assert not problems, problems


DOCS_MELODY_SCREENSHOT = DOCS_SCREENSHOT.with_name("serve-melody.png")
FAKE_MICROPHONE = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]


def hummed(path: Path) -> Path:
    """A hummed melody (16 quarter notes at 100 bpm) as a 48 kHz WAV file at `path`."""
    from melodies import synthesize, wav_bytes

    twinkle = [60, 60, 67, 67, 69, 69, 67, 67, 65, 65, 64, 64, 62, 62, 60, 60]
    path.write_bytes(wav_bytes(synthesize([(i, 1, p) for i, p in enumerate(twinkle)], 100, rate=48000,
                                          vibrato_semitones=0.2, noise_dbfs=-50), 48000))
    return path


def test_a_melody_from_a_file_and_a_hum_seen_heard_edited_and_rendered_as_a_cover(server, tmp_path):
    """The melody source: a file that is not audio refused (the server's 422 on the panel), a hummed melody's file
    transcribed into the score panel (notation, the reader's verdict, its facts and warnings), edited and rendered as
    a cover with the form's style, lyrics and seed (cot melody; the song records the transcription, edited); and a
    hum recorded from the microphone (faked from the same file), sent as 16-bit WAV and transcribed."""
    from yue2_vllm.score_notes import check_score

    hum = hummed(tmp_path / "hum.wav")
    client = server.client
    expected = client.post("/v1/transcriptions", files={"audio": ("hum.wav", hum.read_bytes(), "audio/wav")},
                           data={"lyrics": "[verse]\nla la\n"}, timeout=300)
    assert expected.status_code == 200, expected.text
    problems, uploads = [], []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=[
            *ARGS, *FAKE_MICROPHONE, f"--use-file-for-fake-audio-capture={hum}"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.on("console", lambda message: message.type == "error" and problems.append(message.text))
        page.on("response", lambda response: response.url.endswith("/v1/transcriptions")
                and uploads.append(response))
        page.goto(server.url + "/")
        page.locator("#health.ok").wait_for()
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.fill("#style", "pop, piano, warm female vocal")
        page.fill("#lyrics", "[verse]\nla la\n")
        page.fill("#seed", "5")

        page.set_input_files("#melody-file", files=[{"name": "notes.txt", "mimeType": "text/plain",
                                                     "buffer": b"these are not notes"}])
        shown(page, "#melody-error", problems, timeout=300_000)
        assert page.inner_text("#melody-error").startswith("422: audio: not audio libsndfile reads")
        assert page.is_hidden("#score-card")

        page.fill("#melody-bpm", "500")  # a knob the server refuses: on its field
        page.set_input_files("#melody-file", str(hum))
        wait_for(lambda: page.inner_text("#melody-error"), lambda text: text.startswith("422: bpm:"), timeout=60)
        assert page.get_attribute("#melody-bpm", "aria-invalid") == "true"
        page.fill("#melody-bpm", "")
        page.click("#melody-transcribe")
        shown(page, "#notation svg", problems, timeout=300_000)
        assert page.input_value("#score-text") == expected.json()["abc"]
        assert page.inner_text("#score-check") == "Reads as YuE2's score: it renders with cot melody (no chord " \
                                                  "symbols)."
        assert page.evaluate("document.querySelectorAll('#notation .abcjs-note.abcjs-v0').length") == 16
        facts = page.inner_text("#melody-facts")
        assert facts.startswith("Transcribed by pyin-1 (librosa ") and "4/4 · K:C · ♩ = 100" in facts, facts
        codes = page.evaluate("[...document.querySelectorAll('#melody-warnings li')].map((li) => li.dataset.code)")
        assert codes == [w["code"] for w in expected.json()["transcription"]["warnings"]]
        assert page.is_hidden("#melody-licence")  # pyin's score carries no licence
        page.click("#score-play")  # heard: the synth plays its 16 notes
        wait_for(lambda: page.evaluate("scoreSynth.started.Vocal"), lambda count: count == 16, timeout=30)
        page.click("#score-play")
        time.sleep(0.3)
        shot = tmp_path / "serve-melody.png"
        page.screenshot(path=str(shot), full_page=True)

        edited = expected.json()["abc"].replace("C4C4G4G4|", "C4C4G4A4|")
        page.click("#score-editor summary")
        page.fill("#score-text", edited)
        wait_for(lambda: page.inner_text("#score-render-hint"),
                 lambda text: text.startswith("Makes a cover: a new song from this melody"), timeout=30)
        assert check_score(edited)["valid"] and "cot melody" in page.inner_text("#score-check")
        page.click("#score-render")
        shown(page, "#current-cover", problems)
        job_id = page.evaluate("location.hash").lstrip("#")
        doc = finished(client, job_id)
        assert doc["status"] == "complete", doc["error"]
        request = doc["request"]
        assert (request["style"], request["lyrics"], request["seed"], request["cot"], request["abc"]) == \
            ("pop, piano, warm female vocal", "[verse]\nla la\n", 5, "melody", edited)
        assert request["transcription"] == {**expected.json()["transcription"], "edited": True}
        assert doc["result"]["transcription"] == request["transcription"]
        assert client.get(f"/v1/songs/{job_id}/score").text == edited
        wait_for(lambda: page.inner_text("#current-cover-facts"), lambda text: "the score edited since" in text,
                 timeout=30)

        page.click("#melody-record")  # a hum from the microphone: the same melody, played by the fake device
        page.locator("#melody-record.recording").wait_for()
        time.sleep(5)
        page.click("#melody-record")
        wait_for(lambda: page.inner_text("#melody-recording"), lambda text: text.startswith("recorded"), timeout=30)
        wait_for(lambda: page.inner_text("#melody-status") + page.inner_text("#melody-error"),
                 lambda text: text == "", timeout=300)
        assert len(uploads) == 4 and uploads[-1].status == 200, [u.status for u in uploads]
        source = uploads[-1].json()["transcription"]["source"]  # the recording, sent as 16-bit WAV at 16 kHz
        assert (source["format"], source["subtype"], source["sample_rate"], source["channels"]) == \
            ("WAV", "PCM_16", 16000, 1) and 4.5 < source["seconds"] < 6, source
        recorded = page.input_value("#score-text")
        assert recorded != edited and check_score(recorded)["valid"], recorded
        assert page.inner_text("#score-check").startswith("Reads as YuE2's score")
        browser.close()
    assert not [p for p in problems if "status of 422" not in p], problems
    if os.environ.get("YUE2_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, DOCS_MELODY_SCREENSHOT)


def test_a_melody_transcribed_while_a_song_streams_stays_in_the_score_panel(server, tmp_path):
    """The song in view keeps streaming (every event redraws its view) while a melody is transcribed: the melody's
    score stays in the panel, never replaced by the song's, until another song is opened."""
    hum = hummed(tmp_path / "hum.wav")
    client = server.client
    warm = client.post("/v1/transcriptions", files={"audio": ("hum.wav", hum.read_bytes(), "audio/wav")},
                       timeout=300)  # the pool's process started: the page's transcription takes a second or two
    assert warm.status_code == 200, warm.text
    song = client.post("/v1/songs", json={"style": "pop", "lyrics": "[verse]\nla\n",
                                          "semantic_sampling": {"min_tokens": 3000, "max_tokens": 3000}})
    assert song.status_code == 202, song.text
    job_id = song.json()["id"]
    problems = []
    try:
        with keyed_page(server, problems) as page:
            open_listed(page, job_id)
            progress = "JSON.stringify([current.doc.status, current.doc.progress])"
            wait_for(lambda: page.evaluate("current && current.doc.status"), lambda status: status == "generating",
                     timeout=120)
            with page.expect_response(lambda response: response.url.endswith("/v1/transcriptions"),
                                      timeout=120_000) as transcribed:
                page.set_input_files("#melody-file", str(hum))
            assert transcribed.value.status == 200
            melody = transcribed.value.json()["abc"]  # with the form's lyrics: their sections
            wait_for(lambda: page.input_value("#score-text"), lambda text: text == melody, timeout=30)
            seen = page.evaluate(progress)
            wait_for(lambda: page.evaluate(progress), lambda now: now != seen, timeout=60)  # the song streams on
            page.wait_for_timeout(500)
            assert page.evaluate("current.id") == job_id
            assert page.is_visible("#score-card") and page.input_value("#score-text") == melody
            wait_for(lambda: page.text_content("#score-render-hint"),  # in the editor, folded
                     lambda hint: hint.startswith("Makes a cover: a new song from this melody"), timeout=30)
    finally:
        client.post(f"/v1/songs/{job_id}/cancel")
    assert not problems, problems


def test_a_covers_view_shows_where_its_score_came_from_its_warnings_and_licence(server):
    """A song made from a SheetSage2 transcription (its record as POST /v1/transcriptions answers it, sent back with
    the score): its view says what transcribed it, each warning with its figures, and the licence."""
    import hashlib

    from test_instrumental import SCORE
    from yue2_vllm.transcription.sheetsage import LICENCE

    melody = SCORE.replace('"G"', "").replace('"C"', "")
    drift = ("drift: the beats' tempo moves (92.0 to 124.0 bpm over two-bar stretches, 100.0 on average) and one "
             "Q:1/4=100 cannot follow it: from 12.4 s a beat is more than a beat off the source")
    record = {"transcriber": "sheetsage2", "transcriber_version": "m-a-p/SheetSage2@0123abcd (transformers 4.45.2)",
              "source": {"sha256": "ab" * 32, "bytes": 1234, "seconds": 95.2, "format": "FLAC"}, "bpm": 100,
              "meter": "4/4", "key": "G", "licence": LICENCE,
              "warnings": [{"code": "drift", "message": drift, "figures": {"first_beat_off_second": 12.4}}],
              "score_sha256": hashlib.sha256(melody.encode()).hexdigest()}
    response = server.client.post("/v1/songs", json={"style": "pop", "lyrics": "[verse]\nla\n", "cot": "melody",
                                                     "abc": melody, "transcription": record, "stage": "plan"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert finished(server.client, job_id)["request"]["transcription"] == {**record, "edited": False}
    problems = []
    with keyed_page(server, problems) as page:
        open_listed(page, job_id)
        shown(page, "#current-cover", problems)
        assert page.inner_text("#current-cover-facts") == (
            "Transcribed by m-a-p/SheetSage2@0123abcd (transformers 4.45.2) from 1 min 35.2 s of FLAC: 4/4 · K:G · "
            "♩ = 100 · the score as transcribed")
        assert page.inner_text("#current-cover-warnings") == drift
        assert page.inner_text("#current-cover-licence") == f"Licence: {LICENCE}"
        # rendered again from its score panel: the new song keeps the record (its licence; the score unedited)
        page.click("#score-editor summary")
        wait_for(lambda: page.inner_text("#score-check"), lambda text: "cot melody" in text, timeout=30)
        page.click("#score-render")
        wait_for(lambda: page.evaluate("location.hash"), lambda shown: shown not in ("", f"#{job_id}"), timeout=30)
        new_id = page.evaluate("location.hash").lstrip("#")
        try:
            request = server.client.get(f"/v1/songs/{new_id}").json()["request"]
            assert (request["abc"], request["transcription"]) == (melody, {**record, "edited": False})
        finally:
            server.client.post(f"/v1/songs/{new_id}/cancel")
    assert not problems, problems
