"""Scripts written for upstream's Python API run unchanged on ours (but for the package's name): the calls below are
shaped exactly as upstream's README and examples/ make them (yue2-facts.md §1; README.md's quick start, cover and
edit sections, examples/generate.py, examples/instrumental_clip.py), on the tiny checkpoints and the CPU. Each
gives the song our own API gives for the same request."""
import dataclasses
import inspect
import json

import numpy as np
import pytest
import soundfile

from yue2_vllm.artifacts import verify_result
from yue2_vllm.checkpoint import HashCache, sha256_file
from yue2_vllm.options import AROptions, LoadOptions
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest

# Short songs, so that the tiny model's runs take seconds (upstream's from_pretrained takes generation_config too).
GENERATION = {"abc": {"max_tokens": 8, "min_tokens": 4}, "semantic": {"max_tokens": 16, "min_tokens": 8},
              "ode_steps": 2}
SONG_JSON = {"id": "city_lights", "style": "English, piano pop, warm female vocal", "lyrics": "[verse]\nla la la\n",
             "cot": "full", "seed": 7}
MELODY = "X:1\nT:melody\nM:4/4\nL:1/8\nK:C\nV:Vocal\nCDEF GABc|\n"
TOKENS_PER_SECOND = 25  # examples/instrumental_clip.py's


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    """README.md: `with YuE2Pipeline.from_pretrained("m-a-p/YuE2-3B", device="cuda") as pipe:` (a directory and the
    CPU here)."""
    with YuE2Pipeline.from_pretrained(str(tiny_model_dir), vae=str(tiny_vae_dir), device="cpu",
                                      generation_config=GENERATION, progress=False,
                                      hash_cache=HashCache(tmp_path_factory.mktemp("h") / "h.json")) as pipe:
        yield pipe


def test_the_constructor_takes_upstreams_keywords_with_their_meanings(tiny_model_dir, tiny_vae_dir, tmp_path):
    keywords = dict(device="cpu", memory_budget_gib=24, backend="torch", generation_config=None, verify_hashes=True,
                    vae_core_frames=None, quantization="none", offload_ar=False, progress=True)
    inspect.signature(YuE2Pipeline).bind("m", "v", **keywords)  # real parameters, as upstream's
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, **keywords) as pipe:
        options = pipe.options
        assert (options.device.device, options.device.budget_gib, options.device.vae_core_frames) == ("cpu", 24, 1024)
        assert (options.ar.backend, options.ar.quantization, options.load.verify_hashes) == ("torch", "none", True)
        assert pipe.verify_hashes is True and pipe.progress is True and options.device.offload_ar is False
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, device="cpu", memory_budget_gib=8, backend="torch-eager",
                      load=LoadOptions(hash_cache=HashCache(tmp_path / "h.json"))) as eager:
        # upstream's torch-eager: our torch backend decoding eagerly; its 12 GiB rule for the VAE tile
        assert (eager.options.ar.backend, eager.options.ar.torch_execution) == ("torch", "eager")
        assert eager.options.device.vae_core_frames == 512
        config = eager.effective_config(SongRequest(**SONG_JSON))
        assert (config["backend"], config["memory_budget_gib"], config["vae_core_frames"]) == ("torch", 8, 512)


def test_the_readme_quick_start(pipe, tmp_path, capsys):
    """README.md: `song = pipe(**request)`, `song.save_artifacts(...)`, `print(song.truncated)`."""
    request = json.loads(json.dumps(SONG_JSON))
    song = pipe(**request)
    song.save_artifacts(tmp_path / "outputs" / "my-song")
    print(song.truncated)
    assert capsys.readouterr().out == f"{song.truncated}\n" and set(song.truncated) == {"abc", "semantic"}
    out = tmp_path / "outputs" / "my-song"
    document = verify_result(out, song.identity)
    assert {"audio.flac", "score.abc", "abc_tokens.npy", "prefix.npy", "plan.json", "plan_manifest.json",
            "semantic.npy", "latent.npy", "request.json", "config.json"} == set(document["artifacts"])
    assert (document["status"], document["sample_rate"], document["truncated"]) == ("complete", 48000, song.truncated)
    audio, rate = soundfile.read(str(out / "audio.flac"), dtype="float32", always_2d=True)
    assert rate == 48000 and audio.shape == song.audio.shape
    assert np.load(out / "semantic.npy").tolist() == song.semantic.tokens
    assert np.array_equal(np.load(out / "latent.npy"), song.latents)
    assert json.loads((out / "request.json").read_text()) == SongRequest(**SONG_JSON).to_dict()
    assert json.loads((out / "config.json").read_text()) == song.config
    ours = pipe(SongRequest(**SONG_JSON))  # our API, the same song
    assert ours.identity == song.identity and ours.semantic.tokens == song.semantic.tokens
    assert np.array_equal(ours.audio, song.audio)
    # upstream's SongResult names beside ours
    assert song.request_identity == song.identity and song.abc == song.plan.abc is not None


def test_the_readme_cover_and_edit(pipe, tmp_path):
    """README.md: `pipe(style=..., lyrics=..., abc=..., cot="melody", seed=42)`; `plan = pipe.plan(**request)`,
    `plan.save("outputs/plan")`."""
    cover = pipe(style="English, jazz-funk, warm lead vocal, Rhodes, bass and drums", lyrics="[verse]\nla la\n",
                 abc=MELODY, cot="melody", seed=42)
    cover.save_artifacts(tmp_path / "outputs" / "cover")
    assert cover.plan.abc == MELODY and cover.plan.timing["output_tokens"] == 0
    assert (tmp_path / "outputs" / "cover" / "score.abc").read_text() == MELODY
    request = json.loads(json.dumps(SONG_JSON))
    plan = pipe.plan(**request)
    plan.save(tmp_path / "outputs" / "plan")
    saved = tmp_path / "outputs" / "plan"
    manifest = json.loads((saved / "plan_manifest.json").read_text())
    assert set(manifest) == {"plan.json", "abc_tokens.npy", "prefix.npy", "score.abc"}
    assert all(sha256_file(saved / name) == digest for name, digest in manifest.items())
    record = json.loads((saved / "plan.json").read_text())
    assert (record["abc_ids"], record["prefix"], record["abc"]) == (plan.abc_ids, plan.prefix, plan.abc)
    assert np.load(saved / "abc_tokens.npy").tolist() == plan.abc_ids
    assert (saved / "score.abc").read_text(encoding="utf-8") == plan.abc
    assert pipe.plan(SongRequest(**SONG_JSON)).abc_ids == plan.abc_ids  # our API's plan of the same request


def test_examples_generate_py(tiny_model_dir, tiny_vae_dir, tmp_path):
    """examples/generate.py: from_pretrained(model, vae=, revision=, vae_revision=, device=), `pipe(**request)`,
    `song.save_artifacts(output)`, `json.dumps({"audio": ..., "truncated": song.truncated})`."""
    request = {**SONG_JSON, "abc": MELODY, "cot": "melody"}
    with YuE2Pipeline.from_pretrained(
        str(tiny_model_dir), vae=str(tiny_vae_dir), revision=None,
        vae_revision=None, device="cpu", generation_config=GENERATION, progress=False,
    ) as pipe:
        song = pipe(**request)
        song.save_artifacts(tmp_path / "out")
        line = json.dumps({"audio": str(tmp_path / "out" / "audio.flac"), "truncated": song.truncated})
    assert json.loads(line)["truncated"] == song.truncated and song.truncated["abc"] is False  # a given score
    assert verify_result(tmp_path / "out", song.identity)["identity"] == song.identity


def test_examples_instrumental_clip_py(pipe):
    """examples/instrumental_clip.py: `pipe.plan(request=SongRequest(...))`, `planned.truncated` / `.abc`,
    `pipe.plan(**request)` with a score, `dataclasses.replace(pipe.generation_config.semantic, max_tokens=...)`,
    `pipe.generate_semantic(plan, sampling=budget)`, `pipe.decode(pipe.synthesize(semantic))`."""
    planned = pipe.plan(request=SongRequest(id="clip", style="warm solo piano", lyrics="[Intro]\n\n[Verse]\n",
                                            cot="full", seed=7))
    assert isinstance(planned.truncated, bool) and planned.abc is not None and planned.abc_ids
    request = dict(id="clip", style="Instrumental, warm solo piano, no vocals.", lyrics="[verse]\n", abc=MELODY,
                   cot="melody", seed=7)
    plan = pipe.plan(**request)
    seconds = 0.32
    budget = dataclasses.replace(pipe.generation_config.semantic, max_tokens=int(seconds * TOKENS_PER_SECOND) + 2)
    semantic = pipe.generate_semantic(plan, sampling=budget)
    audio = pipe.decode(pipe.synthesize(semantic))
    frames = len(semantic.tokens)
    assert 8 <= frames <= 10 and audio.shape == (1920 * frames - 64, 2) and audio.dtype == np.float32
    assert semantic.truncated == (frames == 10)
    assert audio[: int(seconds * 48000)].shape == (min(15360, 1920 * frames - 64), 2)


def test_the_generation_guides_saved_plan_restored(pipe, tmp_path):
    """docs/generation.md: `plan.save("outputs/plan")`, `restored = SymbolicPlan.load("outputs/plan")`,
    `pipe.generate_semantic(restored)`, `pipe.synthesize`, `pipe.decode`: the plan's exact ids come back and give
    the song the plan itself gives; a changed or incomplete saved plan is refused in one line naming the file."""
    import shutil

    from yue2_vllm.pipeline import SymbolicPlan

    plan = pipe.plan(**json.loads(json.dumps(SONG_JSON)))
    plan.save(tmp_path / "plan")
    restored = SymbolicPlan.load(tmp_path / "plan")
    assert (restored.request, restored.abc, restored.abc_ids, restored.prefix, restored.timing, restored.truncated) \
        == (plan.request, plan.abc, plan.abc_ids, plan.prefix, plan.timing, plan.truncated)
    semantic = pipe.generate_semantic(restored)
    assert semantic.tokens == pipe.generate_semantic(plan).tokens
    assert pipe.decode(pipe.synthesize(semantic)).shape == (1920 * len(semantic.tokens) - 64, 2)

    def refused(edit, words):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "plan", copy)
        edit(copy)
        with pytest.raises(ValueError) as caught:
            SymbolicPlan.load(copy)
        assert words.format(copy) in str(caught.value) and "\n" not in str(caught.value), str(caught.value)

    refused(lambda d: (d / "score.abc").write_text(plan.abc + "|\n", encoding="utf-8"),
            "{}/score.abc: changed since the plan was saved; give an edited score as a new request's abc")
    def listed_extra(directory):
        (directory / "extra.txt").write_text("x")
        manifest = json.loads((directory / "plan_manifest.json").read_text())
        (directory / "plan_manifest.json").write_text(json.dumps({**manifest, "extra.txt": sha256_file(
            directory / "extra.txt")}))

    refused(listed_extra, "{}/extra.txt: not a plan file")
    refused(lambda d: (d / "plan_manifest.json").write_text(json.dumps({"plan.json": "0" * 64})),
            "{}/plan_manifest.json: lists no complete plan")
    refused(lambda d: (d / "plan_manifest.json").unlink(), "{}: cannot read the saved plan")


def test_decode_takes_upstreams_keywords_and_latent_shape(tiny_model_dir, tiny_vae_dir, tmp_path):
    """Upstream's `decode(latents, full=..., vae=...)` (its skill decodes cached latents with another decoder) and
    its `[1, 64, T]` latents; `device=torch.device(...)` as upstream takes it."""
    import torch

    from yue2_vllm.testing import write_tiny_vae

    other = write_tiny_vae(tmp_path / "other-vae", seed=1)
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, device=torch.device("cpu"), vae_core_frames=4,
                      generation_config=GENERATION, hash_cache=HashCache(tmp_path / "h.json")) as pipe:
        assert pipe.options.device.device == "cpu" and pipe.device == torch.device("cpu")
        latents = pipe.synthesize(pipe.generate_semantic(pipe.plan(**SONG_JSON)))
        tiled = pipe.decode(latents)
        assert len(latents) > 4  # more than one tile
        assert np.array_equal(pipe.decode(latents.T[None]), tiled)
        assert np.array_equal(pipe.decode(latents, vae=str(tiny_vae_dir)), tiled)
        shown = []
        full = pipe.decode(latents, full=True, on_progress=lambda *event: shown.append(event))
        assert shown == [("vae", 1, 1)] and full.shape == tiled.shape and full.dtype == np.float32
        np.testing.assert_allclose(full, tiled, rtol=0, atol=1e-4)  # tiles equal the whole up to conv rounding
        again = pipe.decode(latents, full=True)
        assert np.array_equal(again, full)
        assert not np.allclose(pipe.decode(latents, vae=other), tiled, atol=1e-3)  # another decoder's audio
        with pytest.raises(ValueError, match=r"^latents must be \[frames, 64\] or \[1, 64, frames\], got \[2, 64, "):
            pipe.decode(np.stack([latents.T, latents.T]))


def test_a_song_cancelled_during_the_nar_is_not_decoded(pipe):
    """As upstream's `__call__`: the cancellation is checked once more before the VAE."""
    done = {"nar": False}
    decoded = []

    def progress(stage, count, total):
        done["nar"] = done["nar"] or (stage == "nar" and count == total)
        if stage == "vae":
            decoded.append(count)

    with pytest.raises(InterruptedError, match="^cancelled before the VAE$"):
        pipe(**SONG_JSON, cancelled=lambda: done["nar"], on_progress=progress)
    assert done["nar"] and decoded == []


def test_a_request_is_ours_or_upstreams_keywords_never_both(pipe):
    with pytest.raises(ValueError, match="^style and tags are aliases and cannot disagree$"):
        pipe.plan(style="pop", tags="rock", lyrics="la")
    with pytest.raises(ValueError, match=r"^Provide style and lyrics \(or a SongRequest\)$"):
        pipe(style="pop")
    with pytest.raises(TypeError, match="^seed given beside a SongRequest, which holds the whole song"):
        pipe(SongRequest(**SONG_JSON), seed=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lang'"):
        pipe(**SONG_JSON, lang="en")  # upstream's SongRequest refuses it too
    assert pipe.plan(tags="pop", lyrics="la", cot="off").request == SongRequest("pop", "la", cot="off")


def test_progress_is_upstreams_english_bars_on_stderr(pipe, tiny_model_dir, tiny_vae_dir, tmp_path, capfd):
    """from_pretrained's `progress` (default True, as upstream's) goes on to the pipeline; with it each stage of a
    song shows its English bar on stderr, nothing on stdout, and no record changes."""
    with YuE2Pipeline.from_pretrained(str(tiny_model_dir), vae=None, device="cpu",
                                      hash_cache=HashCache(tmp_path / "h.json")) as shown:
        assert shown.progress is True
    request = SongRequest(**SONG_JSON)
    quiet_config = pipe.effective_config(request)
    capfd.readouterr()
    pipe.progress = True
    try:
        tokens = []
        song = pipe(**SONG_JSON, on_token=lambda phase, token: tokens.append(phase))
        bars = capfd.readouterr()
        assert pipe.effective_config(request) == quiet_config == song.config  # display never enters a record
    finally:
        pipe.progress = False
    assert bars.out == ""
    for label in ("Planning score", "Generating song", "Synthesizing audio", "Decoding audio"):
        assert label in bars.err
    # each emitted token once, the end token too (upstream's on_token), with the bars shown or not
    assert tokens.count("semantic") == len(song.semantic.tokens) + (0 if song.truncated["semantic"] else 1)
    pipe.plan(request)
    assert capfd.readouterr().err == ""
