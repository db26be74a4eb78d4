"""Disk admission by the song: the bytes a request's budgets can write (real figures of a 6-minute song), the
FLAC bound against real soundfile output, and a server refusing a song the free disk cannot hold beside the
songs it already admitted."""
from dataclasses import replace

import numpy as np
import pytest

from yue2_vllm.artifacts import flac_bytes
from yue2_vllm.protocol import GenerationConfig, SongRequest, SongRules, abc_prompt
from yue2_vllm.serve.disk import DiskLedger, SongBytes, flac_bound, request_bytes, song_bytes, written_bytes
from yue2_vllm.serve.service import ServeConfig, SongService

from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe)

MB = 10 ** 6


def test_a_six_minute_song_at_the_default_budgets():
    # 9,000 semantic tokens = 9,000 latent frames = 360 s; 1920·9000 − 64 samples of 24-bit stereo
    samples = 1920 * 9000 - 64
    assert samples == 17_279_936 and samples * 6 == 103_679_616  # the uncompressed PCM
    assert flac_bound(samples) == 103_679_616 + 32 * 16_875 + 65_536 == 104_285_152
    size = song_bytes(prompt_tokens=300, abc_tokens=4096, semantic_tokens=9000, request_text_bytes=500)
    latent, semantic, score, prefix = 9000 * 64 * 4 + 128, 9000 * 4 + 128, 4096 * 4 + 128, (300 + 4098) * 4 + 128
    assert (latent, semantic, score, prefix) == (2_304_128, 36_128, 16_512, 17_720)
    assert size == SongBytes(audio=104_285_152, arrays=latent + semantic + score + prefix,
                             text=256 * 1024 + 4 * 500 + 2 * 4096 * 128)
    assert size.total == 107_972_360  # ~108 MB: a 1 GiB floor held 9 such songs, not a queue of 64
    plan = song_bytes(300, 4096, 9000, 500, stage="plan")
    assert plan.audio == 0 and plan.arrays == score + prefix


def test_request_bytes_read_the_servers_budgets(tokenizer):
    rules = SongRules(GenerationConfig(), tokenizer)
    request = SongRequest("pop, piano", "[verse]\nla la la\n")
    prompt = len(abc_prompt(request, tokenizer))
    text = len("pop, piano".encode()) + len("[verse]\nla la la\n".encode())
    assert request_bytes(rules, request, {}) == song_bytes(prompt, 4096, 9000, text)
    eight_minutes = request_bytes(rules, request, {"semantic": {"max_tokens": 12000}, "abc": {"max_tokens": 512}})
    assert eight_minutes == song_bytes(prompt, 512, 12000, text)
    assert round(eight_minutes.total / MB, 1) == 142.5  # 480 s
    # a song's own length sizes it: a 60 s cap, or a continued song's longer one (beyond the default budget)
    assert request_bytes(rules, replace(request, seconds=60), {}) == song_bytes(prompt, 4096, 1500, text)
    assert request_bytes(rules, replace(request, seconds=480), {"abc": {"max_tokens": 512}}) == eight_minutes


def test_the_flac_bound_holds_for_audio_that_does_not_compress():
    """White noise is FLAC's worst case (verbatim frames): it comes out a little over the uncompressed PCM."""
    samples = 48000 * 10
    noise = np.random.default_rng(0).uniform(-1, 1, (samples, 2)).astype(np.float32)
    written = len(flac_bytes(noise))
    assert samples * 6 < written <= flac_bound(samples)  # measured: 1.0004 x the PCM; the bound is 1.028 x here


def test_the_ledger_counts_what_admitted_songs_have_not_written_yet(tmp_path):
    ledger = DiskLedger(tmp_path, lambda path: 500 * MB)
    calls = []

    def bound(size):
        return lambda: calls.append(size) or size

    song = 108 * MB  # a 6-minute song's bound (above)
    assert ledger.outstanding([("a", "audio", bound(song)), ("b", "audio", bound(song))]) == 2 * song
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "audio.flac").write_bytes(b"x" * 10 ** 6)  # "a" has written 1 MB of its bound
    assert written_bytes(tmp_path / "a") == MB and written_bytes(tmp_path / "none") == 0
    pending = ledger.outstanding([("a", "audio", bound(song)), ("b", "audio", bound(song))])
    assert pending == 2 * song - MB and calls == [song, song]  # each bound is computed once
    assert ledger.room(song, pending, 100 * MB) == (True, 500 * MB)  # 500 − 215 − 100 = 185 MB ≥ 108
    third = ledger.outstanding([("a", "audio", bound(song)), ("b", "audio", bound(song)), ("c", "audio", bound(song))])
    assert ledger.room(song, third, 100 * MB) == (False, 500 * MB)  # a fourth does not fit
    assert ledger.outstanding([]) == 0 and ledger._bounds == {}  # finished jobs are forgotten


def test_the_server_refuses_a_song_the_disk_cannot_hold_beside_the_admitted_ones(pipe, tmp_path):
    """Real figures: a 6-minute budget (9,000 frames; ~107 MB with this pipe's 6-token score) against 250 MB free with a 100 MB floor."""
    service = SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1, min_free_bytes=100 * MB))
    service.disk.free_bytes = lambda path: 250 * MB  # what these machines cannot have: a nearly full disk
    server = ThreadServer(service)
    long_song = {"style": "pop", "lyrics": "[verse]\nla\n", "semantic_sampling": {"min_tokens": 9000,
                                                                                  "max_tokens": 9000}}
    try:
        first = server.client.post("/v1/songs", json=long_song)
        assert first.status_code == 202, first.text
        second = server.client.post("/v1/songs", json=long_song)
        assert second.status_code == 507 and second.headers["retry-after"]
        message = second.json()["error"]["message"]
        assert "the song may write up to 106.9 MB" in message and "250.0 MB free" in message
        assert "promised to 1 unfinished job(s)" in message and "lower semantic_sampling.max_tokens" in message
        small = server.client.post("/v1/songs", json={**long_song, "semantic_sampling": {"max_tokens": 12}})
        assert small.status_code == 202  # a 12-frame song fits beside it
        job = first.json()["id"]
        assert server.client.post(f"/v1/songs/{job}/cancel").status_code in (200, 202)
        wait_for(lambda: server.client.get(f"/v1/songs/{job}").json(), lambda d: d["status"] == "cancelled", 60)
        resumed = server.client.post(f"/v1/songs/{job}/resume")
        assert resumed.status_code == 202  # its own room is free again, less what it has written
        again = server.client.post("/v1/songs", json=long_song)
        assert again.status_code == 507
        server.client.post(f"/v1/songs/{job}/cancel")
    finally:
        server.stop()


def test_retention_defaults_to_a_week_and_forever_keeps_finished_jobs():
    from yue2_vllm.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).retention == 7 * 24 * 3600 == ServeConfig("d").retention_seconds
    assert parser.parse_args(["serve", "--retention", "3600"]).retention == 3600
    assert parser.parse_args(["serve", "--retention", "forever"]).retention is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--retention", "0"])
