"""Hugging Face repo ids, resolved offline through the real huggingface_hub code from a hub cache built here."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yue2_vllm.hub import (ALLOW_PATTERNS, HubError, ModelSource, hub_cache_dir, is_local_name, is_repo_id,
                           resolve_model)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def add_to_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT, *, ref: str | None = "main",
                     skip=()) -> Path:
    """`HF_HOME/hub/models--org--name/` as huggingface_hub lays it out: content-named blobs, a snapshot of
    links to them, and `refs/<ref>` naming the commit. Returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if file.name in skip:
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit, encoding="utf-8")
    return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch, tiny_model_dir, tiny_vae_dir):
    """An offline hub cache holding the tiny model as m-a-p/YuE2-3B and the tiny VAE as m-a-p/YuE2-Vae."""
    home = tmp_path / "hf"
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("YUE2_VLLM_CACHE", str(tmp_path / "yue2-cache"))
    return {"home": home, "model": add_to_hub_cache(home, "m-a-p/YuE2-3B", tiny_model_dir),
            "vae": add_to_hub_cache(home, "m-a-p/YuE2-Vae", tiny_vae_dir)}


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name,repo", [("m-a-p/YuE2-3B", True), ("m-a-p/YuE2-Vae", True), ("org/name.v2_x", True),
                                       ("YuE2-3B", False), ("a/b/c", False), ("/abs/path", False),
                                       ("./m-a-p/YuE2-3B", False), ("org--x/name", False), ("org/na..me", False),
                                       ("org/name-", False), ("org/" + "x" * 97, False), ("", False)])
def test_repo_ids(name, repo):
    assert is_repo_id(name) is repo


def test_local_names_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local_name("m-a-p/YuE2-3B") is False
    (tmp_path / "m-a-p" / "YuE2-3B").mkdir(parents=True)
    assert is_local_name("m-a-p/YuE2-3B") is True  # a directory of that name is read, as upstream does
    assert all(is_local_name(n) for n in ("./x/y", "../x/y", "~/x", "/x/y", "plain"))
    assert resolve_model("m-a-p/YuE2-3B") == ModelSource(Path("m-a-p/YuE2-3B"))
    assert resolve_model(Path("other/name")) == ModelSource(Path("other/name"))  # a Path is always local
    assert resolve_model("m-a-p/YuE2-3B").record() == {"path": str(tmp_path / "m-a-p" / "YuE2-3B")}
    with pytest.raises(ValueError, match=r"^--model m-a-p/YuE2-3B: a revision \('v1'\) applies to Hugging Face "
                                         r"repo ids only, not to a local directory$"):
        resolve_model("m-a-p/YuE2-3B", revision="v1", what="--model")


def test_cache_dir_follows_the_environment(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}) == Path("/c/hub")
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_only_the_files_we_read_are_requested():
    from yue2_vllm.hub import HEAD_PATTERNS

    assert ALLOW_PATTERNS == ("config.json", "model.safetensors", "model.safetensors.index.json",
                              "model-?????-of-?????.safetensors", "weights_manifest.json", "qwen.tiktoken")
    assert HEAD_PATTERNS == ("config.json", "model.safetensors.index.json", "weights_manifest.json", "qwen.tiktoken")


# --------------------------------------------------------------------------- resolution through huggingface_hub


def test_a_cached_repo_id_resolves_offline(hub):
    source = resolve_model("m-a-p/YuE2-3B", what="--model")
    assert source == ModelSource(hub["model"], "m-a-p/YuE2-3B", "main", COMMIT)
    assert os.fspath(source) == str(hub["model"])
    assert source.record() == {"path": str(hub["model"]), "repo_id": "m-a-p/YuE2-3B", "revision": "main",
                               "commit": COMMIT}
    assert resolve_model("m-a-p/YuE2-3B", revision=COMMIT).commit == COMMIT  # a commit needs no ref


def test_a_revision_is_a_ref_of_the_cache(hub, tiny_model_dir):
    snapshot = add_to_hub_cache(hub["home"], "m-a-p/YuE2-3B", tiny_model_dir, OTHER_COMMIT, ref="v2")
    assert resolve_model("m-a-p/YuE2-3B", revision="v2") == ModelSource(snapshot, "m-a-p/YuE2-3B", "v2",
                                                                         OTHER_COMMIT)
    with pytest.raises(HubError) as info:
        resolve_model("m-a-p/YuE2-3B", revision="v3", what="--model")
    assert str(info.value) == (f"--model m-a-p/YuE2-3B (revision v3): not in the Hugging Face cache "
                               f"{hub['home'] / 'hub'} and downloads are off (HF_HUB_OFFLINE); unset HF_HUB_OFFLINE "
                               "to download it")


def test_offline_with_nothing_cached_is_one_line(hub, tmp_path, capsys):
    from yue2_vllm.cli import main

    assert main(["generate", "--model", "m-a-p/Missing", "--vae", "m-a-p/YuE2-Vae", "--output",
                 str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    message = (f"--model m-a-p/Missing (revision main): not in the Hugging Face cache {hub['home'] / 'hub'} and "
               "downloads are off (HF_HUB_OFFLINE); unset HF_HUB_OFFLINE to download it")
    assert json.loads(captured.out) == {"status": "failed", "type": "HubError", "reason": message}
    assert captured.err == f"yue2-vllm: error: {message}\n"


def test_the_model_card_command_runs_from_the_cache(hub, tmp_path, capsys):
    from yue2_vllm.cli import main

    config = tmp_path / "gen.json"
    config.write_text(json.dumps({"abc": {"max_tokens": 4, "min_tokens": 2},
                                  "semantic": {"max_tokens": 6, "min_tokens": 4}, "ode_steps": 1}), encoding="utf-8")
    assert main(["generate", "--model", "m-a-p/YuE2-3B", "--vae", "m-a-p/YuE2-Vae", "--config", str(config),
                 "--quiet", "--style", "pop", "--lyrics", "la", "--id", "s", "--output", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "complete"
    result = json.loads((tmp_path / "out" / "s" / "result.json").read_text(encoding="utf-8"))
    assert result["sources"] == {
        "mot": {"path": str(hub["model"]), "repo_id": "m-a-p/YuE2-3B", "revision": "main", "commit": COMMIT},
        "vae": {"path": str(hub["vae"]), "repo_id": "m-a-p/YuE2-Vae", "revision": "main", "commit": COMMIT}}
    # the same weights from a local copy: the same song identity (sources are recorded beside it, not in it)
    local_model, local_vae = tmp_path / "YuE2-3B", tmp_path / "YuE2-Vae"
    shutil.copytree(hub["model"], local_model)
    shutil.copytree(hub["vae"], local_vae)
    assert main(["generate", "--model", str(local_model), "--vae", str(local_vae), "--config", str(config),
                 "--quiet", "--style", "pop", "--lyrics", "la", "--id", "s", "--output", str(tmp_path / "out2")]) == 0
    local = json.loads((tmp_path / "out2" / "s" / "result.json").read_text(encoding="utf-8"))
    assert local["identity"] == result["identity"]
    assert local["sources"] == {"mot": {"path": str(local_model)}, "vae": {"path": str(local_vae)}}


def test_the_python_api_takes_repo_ids(hub):
    from yue2_vllm.pipeline import YuE2Pipeline

    pipe = YuE2Pipeline.from_pretrained("m-a-p/YuE2-3B", vae="m-a-p/YuE2-Vae", revision=COMMIT,
                                        generation_config={"ode_steps": 1})
    assert (pipe.model_dir, pipe.vae_dir) == (hub["model"], hub["vae"])
    assert pipe.source_records()["mot"] == {"path": str(hub["model"]), "repo_id": "m-a-p/YuE2-3B",
                                            "revision": COMMIT, "commit": COMMIT}
    assert pipe.source_records()["vae"]["revision"] == "main"


def test_serve_and_derive_take_repo_ids(hub, tmp_path, capsys):
    from yue2_vllm.cli import build_parser, main
    from yue2_vllm.cli.setup import song_setup

    args = build_parser().parse_args(["serve", "--model", "m-a-p/YuE2-3B", "--vae", "m-a-p/YuE2-Vae", "--backend",
                                      "torch"])  # no engine for this check
    with song_setup(args).pipeline() as pipe:
        assert (pipe.model_dir, pipe.vae_dir) == (hub["model"], hub["vae"])
    assert main(["derive", "m-a-p/YuE2-3B", "--revision", COMMIT, "--out", str(tmp_path / "ar")]) == 0
    derived = Path(json.loads(capsys.readouterr().out)["ar_checkpoint"])
    assert derived.parent == tmp_path / "ar" / "yue2-ar" and (derived / "model.safetensors").is_file()


@pytest.mark.parametrize("damage,message", [
    (lambda snapshot: (snapshot / "qwen.tiktoken").unlink(), "qwen.tiktoken"),
    (lambda snapshot: _truncate((snapshot / "model.safetensors").resolve()), "truncated"),
])
def test_a_partial_or_corrupt_download_is_caught_by_the_checkpoint_checks(hub, damage, message):
    from yue2_vllm.checkpoint import CheckpointError
    from yue2_vllm.pipeline import YuE2Pipeline

    damage(hub["model"])
    with pytest.raises(CheckpointError, match=message):
        YuE2Pipeline("m-a-p/YuE2-3B", "m-a-p/YuE2-Vae")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def test_local_names_never_import_huggingface_hub(tiny_model_dir):
    code = ("import sys\nfrom yue2_vllm.hub import resolve_model\nimport yue2_vllm.pipeline\n"
            f"resolve_model({str(tiny_model_dir)!r})\n"
            "bad = [m for m in ('huggingface_hub', 'vllm', 'triton', 'llmcompressor') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


# --------------------------------------------------------------------------- upstream's names and from_pretrained

TOKEN = "hf_NotARealTokenButSecret0123456789"


@pytest.fixture()
def hub_calls(monkeypatch):
    """What reaches huggingface_hub: each snapshot_download call's arguments, the real function answering."""
    import huggingface_hub

    calls, real = [], huggingface_hub.snapshot_download

    def spy(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    return calls


def test_the_cli_takes_upstreams_names_from_the_cache(hub, hub_calls, tmp_path, capsys):
    from yue2_vllm.cli import build_parser, main
    from yue2_vllm.cli.setup import song_setup

    parse = build_parser().parse_args
    with song_setup(parse(["serve", "--vae", "standard", "--backend", "torch"])).pipeline() as pipe:
        assert (pipe.model_dir, pipe.vae_dir) == (hub["model"], hub["vae"])
    with song_setup(parse(["generate", "--model", "m-a-p/YuE2-3B", "--quiet"])).pipeline() as pipe:
        assert pipe.source_records()["vae"]["repo_id"] == "m-a-p/YuE2-Vae"
    assert [repo for repo, _ in hub_calls] == ["m-a-p/YuE2-3B", "m-a-p/YuE2-Vae"] * 2
    # download bars on stderr unless --quiet
    assert ["tqdm_class" in kwargs for _, kwargs in hub_calls] == [False, False, True, True]
    assert main(["generate", "--vae", "legacy", "--output", str(tmp_path / "out")]) == 2
    assert json.loads(capsys.readouterr().out)["reason"].startswith(
        "--vae m-a-p/YuE2-Vae-legacy (revision main): not in the Hugging Face cache")
    assert main(["derive", "--out", str(tmp_path / "ar")]) == 0  # upstream's model by default
    assert Path(json.loads(capsys.readouterr().out)["ar_checkpoint"]).parent == tmp_path / "ar" / "yue2-ar"


def test_from_pretrained_defaults_reach_the_hub(hub, hub_calls):
    """upstream's test_pipeline_defaults_and_explicit_revisions_reach_hub, the defaults half."""
    from yue2_vllm.pipeline import YuE2Pipeline

    pipe = YuE2Pipeline.from_pretrained(generation_config={"ode_steps": 1})
    assert (pipe.model_dir, pipe.vae_dir) == (hub["model"], hub["vae"])
    assert [(repo, kwargs["revision"], kwargs["token"]) for repo, kwargs in hub_calls] == [
        ("m-a-p/YuE2-3B", "main", None), ("m-a-p/YuE2-Vae", "main", None)]
    assert all(kwargs["cache_dir"] == str(hub["home"] / "hub") and "tqdm_class" not in kwargs
               for _, kwargs in hub_calls)
    assert pipe.load_timing["resolve_seconds"] >= 0


def test_from_pretrained_explicit_revisions_token_and_cache_dir_reach_the_hub(hub, hub_calls, tiny_model_dir,
                                                                                 tmp_path, monkeypatch, caplog):
    """The other half: explicit revisions, the token and the cache dir go to huggingface_hub — and the token
    to nothing else: no file of the song, no log line, no repr."""
    import logging

    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.protocol import SongRequest

    add_to_hub_cache(hub["home"], "m-a-p/YuE2-3B", tiny_model_dir, OTHER_COMMIT, ref=None)
    cache = tmp_path / "elsewhere"
    shutil.move(hub["home"] / "hub", cache)  # only the cache_dir given holds the repos now
    monkeypatch.delenv("HF_HUB_OFFLINE")  # local_files_only alone keeps it off the network
    caplog.set_level(logging.DEBUG)
    pipe = YuE2Pipeline.from_pretrained(revision=OTHER_COMMIT, vae_revision=COMMIT, token=TOKEN, cache_dir=cache,
                                        local_files_only=True, progress=False,
                                        generation_config={"abc": {"max_tokens": 4, "min_tokens": 2}, "ode_steps": 1,
                                                           "semantic": {"max_tokens": 6, "min_tokens": 4}})
    assert [(repo, kwargs["revision"]) for repo, kwargs in hub_calls] == [("m-a-p/YuE2-3B", OTHER_COMMIT),
                                                                          ("m-a-p/YuE2-Vae", COMMIT)]
    assert all((kwargs["token"], kwargs["cache_dir"], kwargs["local_files_only"]) == (TOKEN, str(cache), True)
               and "tqdm_class" in kwargs for _, kwargs in hub_calls)
    assert pipe.source_records()["mot"]["commit"] == OTHER_COMMIT
    result = pipe.generate_to(tmp_path / "run", SongRequest("pop", "la", id="s", seed=3))
    assert result["sources"]["mot"] == {"path": str(cache / "models--m-a-p--YuE2-3B" / "snapshots" / OTHER_COMMIT),
                                        "repo_id": "m-a-p/YuE2-3B", "revision": OTHER_COMMIT,
                                        "commit": OTHER_COMMIT}
    written = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert written and not [path for path in written if TOKEN.encode() in path.read_bytes()]
    assert TOKEN not in caplog.text and TOKEN not in repr(pipe.sources) and TOKEN not in json.dumps(result)
    # token=False (send none) reaches huggingface_hub as it is, as upstream's test checks
    YuE2Pipeline.from_pretrained(revision=OTHER_COMMIT, vae=None, token=False, cache_dir=cache, local_files_only=True)
    assert hub_calls[-1][1]["token"] is False


def test_from_pretrained_token_defaults_to_hf_token_and_names_local_files_only(hub, hub_calls, monkeypatch):
    from yue2_vllm.pipeline import YuE2Pipeline

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(HubError) as info:
        YuE2Pipeline.from_pretrained(vae="m-a-p/YuE2-Vae-legacy", local_files_only=True)
    assert [(repo, kwargs["token"]) for repo, kwargs in hub_calls] == [("m-a-p/YuE2-3B", TOKEN),
                                                                       ("m-a-p/YuE2-Vae-legacy", TOKEN)]
    assert str(info.value) == (f"vae m-a-p/YuE2-Vae-legacy (revision main): not in the Hugging Face cache "
                               f"{hub['home'] / 'hub'} and downloads are off (local_files_only); drop "
                               "local_files_only to download it")
    with pytest.raises(TypeError, match="progress must be True or False"):
        YuE2Pipeline.from_pretrained(progress="no")


def test_progress_off_draws_no_bar(capsys):
    """progress=False hands huggingface_hub a bar class that stays silent, named groups and all."""
    from yue2_vllm.hub import _silent_bars

    bar = _silent_bars()(total=3, desc="Downloading bytes", unit="B", name="huggingface_hub.snapshot_download")
    bar.update(3)
    bar.close()
    assert bar.disable is True and capsys.readouterr().err == ""


# --------------------------------------------------------------------------- a Ray head: no weights


def test_a_ray_head_resolves_only_the_files_it_reads_and_says_so(tmp_path, monkeypatch, tiny_model_dir,
                                                                 tiny_vae_dir, hub_calls, caplog):
    """The head of `serve --replicas` reads a config, a tokenizer and sizes: its cache needs no weights at all (the
    MoT's size from upstream's weights_manifest.json, the VAE's from the Hub's metadata)."""
    import yue2_vllm.hub as hub_module
    from yue2_vllm.checkpoint import weights_bytes
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import memory_plan, song_setup
    from yue2_vllm.hub import HEAD_PATTERNS

    mot = tmp_path / "mot"
    shutil.copytree(tiny_model_dir, mot)
    mot_bytes = weights_bytes(mot)
    (mot / "weights_manifest.json").write_text(json.dumps({"files": {"model.safetensors": {
        "sha256": hashlib.sha256((mot / "model.safetensors").read_bytes()).hexdigest(), "bytes": mot_bytes}}}))
    home = tmp_path / "hf"
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_to_hub_cache(home, "m-a-p/YuE2-3B", mot, skip=("model.safetensors",))  # what a head's cache holds
    add_to_hub_cache(home, "m-a-p/YuE2-Vae", tiny_vae_dir, skip=("model.safetensors",))
    asked = []

    def hub_sizes(repo_id, revision, hub, env):  # the Hub's file metadata (model_info(files_metadata=True))
        asked.append((repo_id, revision))
        return weights_bytes(tiny_vae_dir)

    monkeypatch.setattr(hub_module, "hub_weight_sizes", hub_sizes)
    args = build_parser().parse_args(["serve", "--vae", "standard", "--backend", "vllm", "--replicas", "2",
                                      "--device", "cpu", "--quiet"])
    with caplog.at_level("WARNING", logger="yue2_vllm"):
        head = song_setup(args, patterns=HEAD_PATTERNS)
        rules, rows = head.admission("cpu")
    assert [(repo, kwargs["allow_patterns"]) for repo, kwargs in hub_calls] == [
        ("m-a-p/YuE2-3B", list(HEAD_PATTERNS)), ("m-a-p/YuE2-Vae", list(HEAD_PATTERNS))]
    assert asked == [("m-a-p/YuE2-Vae", COMMIT)]  # the MoT's size came from its manifest
    assert not list(home.rglob("*.safetensors"))
    # The split the head plans equals the one a machine holding the weights plans.
    expected = memory_plan(mot, tiny_vae_dir, "cpu", generation=rules.generation).max_num_seqs
    assert head.ar.backend == "vllm" and rows == expected
    manifest_bytes = (mot / "weights_manifest.json").stat().st_size
    config_bytes, tokenizer_bytes = ((mot / name).stat().st_size for name in ("config.json", "qwen.tiktoken"))
    assert caplog.messages == [
        f"Ray head: resolved m-a-p/YuE2-3B: config.json, qwen.tiktoken, weights_manifest.json "
        f"({config_bytes + tokenizer_bytes + manifest_bytes} bytes); m-a-p/YuE2-Vae: config.json "
        f"({(tiny_vae_dir / 'config.json').stat().st_size} bytes); the weights are the replicas' to fetch"]


def test_weights_bytes_of_reads_the_manifest_the_index_then_the_hub(tmp_path, monkeypatch):
    import yue2_vllm.hub as hub_module
    from yue2_vllm.hub import weights_bytes_of

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    source = ModelSource(snapshot, "m-a-p/YuE2-3B", "main", COMMIT)
    monkeypatch.setattr(hub_module, "hub_weight_sizes", lambda *args: 7_317_543_936)  # YuE2-3B's two shards
    assert weights_bytes_of(source) == (7_317_543_936, "hub metadata")
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 7_317_500_000},
                                                                       "weight_map": {}}))
    assert weights_bytes_of(source) == (7_317_500_000, "model.safetensors.index.json")
    (snapshot / "weights_manifest.json").write_text(json.dumps({"files": {
        "model-00001-of-00002.safetensors": {"sha256": "0" * 64, "bytes": 4_967_000_000},
        "model-00002-of-00002.safetensors": {"sha256": "1" * 64, "bytes": 2_350_543_936}}}))
    assert weights_bytes_of(source) == (7_317_543_936, "weights_manifest.json")

    def offline(*args):
        raise OSError("offline")

    (snapshot / "weights_manifest.json").unlink()
    (snapshot / "model.safetensors.index.json").unlink()
    monkeypatch.setattr(hub_module, "hub_weight_sizes", offline)
    with pytest.raises(HubError, match=r"m-a-p/YuE2-3B: the size of its weights is in neither .*\(offline\)"):
        weights_bytes_of(source)
