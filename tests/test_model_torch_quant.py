import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from yue2_vllm.checkpoint import CheckpointError, read_header, sha256_file, weight_index, write_safetensors_tensors
from yue2_vllm.model.loader import load_model
from yue2_vllm.model.modeling import CachedNAR
from yue2_vllm.protocol import ABC_START, CODEC_OFFSET, EOD, MUSIC_END
from yue2_vllm.model.torch_quant import (AR_LINEARS, GIB, INT8_AR_METHOD, FP8Linear, Int8Linear, apply_memory_cap,
                                   ar_linear_names, export_int8_ar, int8_linear, int8pack_available, memory_cap,
                                   prepare_ar_proxies, proxy_slow_reason, quantize_fp8, quantize_fp8_per_tensor,
                                   quantize_int8, restore_ar)

PROMPT = [EOD, 40, 1771, 285, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, ABC_START]
TINY_AR = 14  # 7 linears x 2 layers


def count_calls(monkeypatch):
    assert int8pack_available("cpu", torch.bfloat16)  # probe first, outside the spy
    calls = []
    real = torch._weight_int8pack_mm

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", spy)
    return calls


# --------------------------------------------------------------------------- quantize_int8


def test_quantize_int8_hand_made_rows():
    weight = torch.tensor([[127.0, -254.0, 0.0], [1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (3,)
    # row 0: scale 254/127 = 2 exactly; 127/2 = 63.5 rounds half to even -> 64
    # row 1: 1/127 rounds to bf16 0.00787353515625; 1/s = 127.006 -> 127, -0.5/s = -63.50 -> -64, 0.25/s -> 32
    # row 2: a zero row gets scale 1 and zeros
    assert scale.tolist() == [2.0, 0.00787353515625, 1.0]
    assert q.tolist() == [[64, -127, 0], [127, -64, 32], [0, 0, 0]]
    q16, scale16 = quantize_int8(weight.to(torch.bfloat16))
    assert torch.equal(q16, q) and torch.equal(scale16, scale)


def test_quantize_int8_bounds_and_errors():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = quantize_int8(weight)
    assert q.abs().max() == 127 and (q.abs().amax(1) == 127).all()
    error = (q.float() * scale.float()[:, None] - weight.float()).abs()
    assert (error <= scale.float()[:, None] * 0.5 * 1.01).all()
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_int8(torch.ones(4, dtype=torch.int8).reshape(2, 2))


# --------------------------------------------------------------------------- Int8Linear


def make_linear(out_features, in_features, seed=0):
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
                          / in_features ** 0.5).to(torch.bfloat16)
    return linear


def test_int8_linear_uses_packed_kernel_on_cpu_and_matches_reference(monkeypatch):
    module = Int8Linear.from_linear(make_linear(96, 128))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls = count_calls(monkeypatch)
    out = module(x)
    assert calls == [(15, 128)], "torch._weight_int8pack_mm was not used on CPU bf16"
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 96)
    dequantised = torch.nn.functional.linear(x, module.dequantized_weight(torch.bfloat16))
    torch.testing.assert_close(out, dequantised, atol=1e-2, rtol=1.6e-2)
    exact = (x.float() @ module.weight.float().T) * module.weight_scale.float()
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=8e-3)  # fp32 sum, one bf16 rounding
    fallback = int8_linear(x, module.weight, module.weight_scale, kernel=False)
    assert len(calls) == 1 and torch.equal(fallback, dequantised)
    assert module(x.float()).dtype == torch.float32


def test_int8_linear_falls_back_for_unaligned_k_and_realigns_weights(monkeypatch):
    odd = Int8Linear.from_linear(make_linear(32, 40))  # K=40: the x86 kernel returns NaN there
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    calls = count_calls(monkeypatch)
    assert torch.equal(odd(x), torch.nn.functional.linear(x, odd.dequantized_weight()))
    assert calls == []
    module = Int8Linear.from_linear(make_linear(64, 128))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = module(x)
    buffer = torch.empty(64 * 128 + 64, dtype=torch.int8)
    shifted = buffer[8:8 + 64 * 128].view(64, 128)  # 8-byte offset, as safetensors hands tensors out
    shifted.copy_(module.weight)
    module.weight = shifted
    assert torch.equal(module(x), expected)  # would crash inside the kernel without realignment
    assert module.weight.data_ptr() % 64 == 0


# --------------------------------------------------------------------------- export / load


@pytest.fixture(scope="module")
def int8_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "YuE2-3B-tiny-int8"
    report = export_int8_ar(tiny_model_dir, out)
    assert report.quantized_linears == TINY_AR and report.tensors == 56 + TINY_AR
    return out


@pytest.fixture(scope="module")
def int8_model(int8_dir):
    return load_model(int8_dir)


def test_export_layout_config_and_bytes(tiny_model_dir, int8_dir):
    source, written = weight_index(tiny_model_dir), weight_index(int8_dir)
    ar = {f"{name}.weight" for name in ar_linear_names(2)}
    assert set(written) == set(source) | {name.replace(".weight", ".weight_scale") for name in ar}
    for name, info in written.items():
        if name in ar:
            assert info.dtype == "I8" and info.shape == source[name].shape
        elif name.endswith(".weight_scale"):
            assert info.dtype == "BF16" and info.shape == source[name.replace("_scale", "")].shape[:1]
        else:
            assert info.dtype == source[name].dtype and info.shape == source[name].shape

    def raw(info):
        with open(info.file, "rb") as handle:
            handle.seek(info.data_offset + info.start)
            return handle.read(info.nbytes)

    for name in set(source) - ar:
        assert raw(written[name]) == raw(source[name]), name
    config = json.loads((int8_dir / "config.json").read_text())
    source_config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config.pop("quantization_config") == {
        "method": INT8_AR_METHOD, "source_weights_sha256": sha256_file(tiny_model_dir / "model.safetensors"),
        "bits": 8, "group": "per_output_channel"}
    assert config == source_config
    assert (int8_dir / "qwen.tiktoken").read_bytes() == (tiny_model_dir / "qwen.tiktoken").read_bytes()
    assert sorted(p.name for p in int8_dir.iterdir()) == ["config.json", "model.safetensors", "qwen.tiktoken"]
    _, metadata = read_header(int8_dir / "model.safetensors")
    assert metadata["quantization"] == INT8_AR_METHOD


def test_exported_weights_are_quantize_int8_of_the_source(tiny_model, int8_model):
    for name in ar_linear_names(2):
        q, scale = quantize_int8(tiny_model.get_submodule(name).weight)
        module = int8_model.get_submodule(name)
        assert isinstance(module, Int8Linear)
        assert torch.equal(module.weight, q) and torch.equal(module.weight_scale, scale)
    for name in ("lm_head", "model.layers.0.nar_self_attn.q_proj", "model.layers.1.nar_mlp.down_proj", "llm2vae"):
        assert type(int8_model.get_submodule(name)) is nn.Linear


def test_checkpoint_logits_equal_load_time_quantization(tiny_model_dir, tiny_model, int8_model):
    ids = torch.tensor([PROMPT])
    loaded = int8_model.forward_ar(ids, logits_to_keep=0)
    load_time = load_model(tiny_model_dir, quantization="int8")
    assert load_time.quantization_status["source"] == "load_time"
    assert torch.equal(loaded, load_time.forward_ar(ids, logits_to_keep=0))
    proxied = copy.deepcopy(tiny_model)
    prepare_ar_proxies(proxied, "int8")
    assert torch.equal(loaded, proxied.forward_ar(ids, logits_to_keep=0))
    bf16 = tiny_model.forward_ar(ids, logits_to_keep=0).float()
    assert 0 < (loaded.float() - bf16).abs().max() < 0.25
    assert (loaded.float().argmax(-1) == bf16.argmax(-1)).float().mean() > 0.9
    status = int8_model.quantization_status
    assert status["mode"] == "int8" and status["source"] == "checkpoint" and status["active_ar_linears"] == TINY_AR
    assert status["kernel"] == "_weight_int8pack_mm" and status["source_weights_sha256"]


def test_int8_checkpoint_refuses_none_and_fp8(int8_dir):
    for mode in ("none", "fp8"):
        with pytest.raises(ValueError, match=rf"quantization_config.method 'yue2-int8-ar'.*quantization='{mode}'"):
            load_model(int8_dir, quantization=mode)
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(int8_dir, quantization="int4")
    assert load_model(int8_dir, quantization="int8").quantization_status["mode"] == "int8"


def test_int8_checkpoint_layout_is_checked(int8_dir, tmp_path):
    import shutil

    bad = tmp_path / "no-qc"
    shutil.copytree(int8_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    method = config.pop("quantization_config")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected 14: .*weight_scale.*dtype I8"):
        load_model(bad)
    config["quantization_config"] = {**method, "method": "gptq"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: quantization_config method 'gptq' is not supported"):
        load_model(bad)


def test_int8_checkpoint_nar_uses_dequantised_ar_prefix(tiny_model, int8_model):
    tokens = PROMPT + [CODEC_OFFSET + c for c in (5, 7, 32767, 0, 9)] + [MUSIC_END]
    state = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    velocity = CachedNAR(int8_model, tokens, frames=5).velocity(state, 0.5)
    assert velocity.shape == (5, 64) and torch.isfinite(velocity).all()
    proxied = copy.deepcopy(tiny_model)
    prepare_ar_proxies(proxied, "int8")
    assert torch.equal(velocity, CachedNAR(proxied, tokens, frames=5).velocity(state, 0.5))
    bf16 = CachedNAR(tiny_model, tokens, frames=5).velocity(state, 0.5)
    assert not torch.equal(velocity, bf16)
    assert (velocity.float() - bf16.float()).abs().max() < 0.1 * bf16.float().abs().max()
    restore_ar(proxied)
    assert torch.equal(CachedNAR(proxied, tokens, frames=5).velocity(state, 0.5), bf16)


def test_export_refuses_existing_target_and_quantized_source(tiny_model_dir, int8_dir, tmp_path):
    with pytest.raises(FileExistsError):
        export_int8_ar(tiny_model_dir, int8_dir)
    with pytest.raises(ValueError, match="already has a quantization_config"):
        export_int8_ar(int8_dir, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_streaming_writer_checks_declared_sizes(tmp_path):
    good = [("a", "BF16", (2, 3), lambda: torch.ones(2, 3, dtype=torch.bfloat16)),
            ("b", "I8", (4,), lambda: iter([b"\x01\x02", b"\x03\x04"]))]
    write_safetensors_tensors(tmp_path / "ok.safetensors", good, {"format": "pt"})
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "ok.safetensors"))
    assert torch.equal(loaded["a"], torch.ones(2, 3, dtype=torch.bfloat16)) and loaded["b"].tolist() == [1, 2, 3, 4]
    with pytest.raises(CheckpointError, match="'b' produced 3 bytes, its header says 4"):
        write_safetensors_tensors(tmp_path / "short.safetensors", [("b", "I8", (4,), lambda: b"abc")])
    with pytest.raises(CheckpointError, match="declared F32"):
        write_safetensors_tensors(tmp_path / "dtype.safetensors", [("a", "F32", (2,), lambda: torch.ones(2).half())])


# --------------------------------------------------------------------------- load-time proxies


def linear_types(model):
    return {name: type(module) for name, module in model.named_modules() if isinstance(module, (nn.Linear, Int8Linear,
                                                                                              FP8Linear))}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_proxies_swap_only_ar_linears_and_restore_exactly(tiny_model, mode):
    model = copy.deepcopy(tiny_model)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    types = linear_types(model)
    status = prepare_ar_proxies(model, mode, reference=True)
    proxy = Int8Linear if mode == "int8" else FP8Linear
    swapped = {name for name, cls in linear_types(model).items() if cls is proxy}
    assert swapped == set(ar_linear_names(2)) and len(swapped) == TINY_AR
    assert all(types[name] is nn.Linear and linear_types(model)[name] is nn.Linear for name in types
               if name not in swapped)
    assert status["mode"] == mode and status["active_ar_linears"] == TINY_AR and status["restorable"]
    assert model.quantization_status == status
    originals = model._yue2_ar_originals
    assert type(originals) is dict and len(originals) == TINY_AR
    assert all(m.weight.device.type == "cpu" for m in originals.values())
    assert not any(key.startswith("_yue2") for key in model.state_dict())
    layer0 = model.model.layers[0].self_attn.q_proj
    assert prepare_ar_proxies(model, mode, reference=True) == status  # idempotent
    assert model.model.layers[0].self_attn.q_proj is layer0
    other = "fp8" if mode == "int8" else "int8"
    with pytest.raises(ValueError, match="call restore_ar"):
        prepare_ar_proxies(model, other, reference=True)
    logits = model.forward_ar(torch.tensor([PROMPT]))
    assert torch.isfinite(logits.float()).all()
    assert restore_ar(model)["mode"] == "none" and not hasattr(model, "_yue2_ar_originals")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) and after[name].dtype == before[name].dtype for name in before)
    assert linear_types(model) == types
    assert restore_ar(model)["mode"] == "none"  # a second restore is a no-op


def test_originals_stay_on_cpu_when_the_model_moves(tiny_model):
    model = copy.deepcopy(tiny_model)
    prepare_ar_proxies(model, "int8")
    model.to("meta")
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    originals = model._yue2_ar_originals
    assert all(m.weight.device.type == "cpu" for m in originals.values())
    assert torch.equal(originals["model.layers.1.mlp.up_proj"].weight, tiny_model.model.layers[1].mlp.up_proj.weight)


def test_fp8_proxy_accuracy_and_device_refusal(tiny_model, tiny_model_dir):
    linear = make_linear(96, 128)
    q, scale = quantize_fp8(linear.weight)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.allclose(q.float().abs().amax(1), torch.full((96,), 448.0))
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    reference = FP8Linear.from_linear(linear, reference=True)
    out, exact = reference(x).float(), linear(x).float()
    assert (out - exact).norm() / exact.norm() < 0.15
    with pytest.raises(RuntimeError, match="compute capability >= 8.9.*reference=True"):
        FP8Linear.from_linear(linear)(x)
    with pytest.raises(ValueError, match="CUDA GPU with compute capability >= 8.9"):
        prepare_ar_proxies(copy.deepcopy(tiny_model), "fp8")
    with pytest.raises(ValueError, match="CUDA GPU with compute capability >= 8.9"):
        load_model(tiny_model_dir, quantization="fp8")
    with pytest.raises(ValueError, match="mode must be one of"):
        prepare_ar_proxies(copy.deepcopy(tiny_model), "int4")


def test_fp8_per_tensor_quantization_hand_values():
    q, scale = quantize_fp8_per_tensor(torch.tensor([[448.0, -2.0], [1.0, 0.0]], dtype=torch.bfloat16))
    assert scale.tolist() == [1.0] and q.float().tolist() == [[448.0, -2.0], [1.0, 0.0]]
    q, scale = quantize_fp8_per_tensor(torch.tensor([[896.0, 4.0], [-896.0, 0.5]]))
    assert scale.tolist() == [2.0] and q.float().tolist() == [[448.0, 2.0], [-448.0, 0.25]]
    q, scale = quantize_fp8_per_tensor(torch.zeros(2, 16))
    assert scale.item() == pytest.approx(1e-12 / 448) and not q.float().any()


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_fp8_schemes_reference_accuracy_and_status(tiny_model, scheme):
    linear = make_linear(96, 128, seed=3)
    module = FP8Linear.from_linear(linear, reference=True, scheme=scheme)
    assert module.weight_scale.shape == ((1,) if scheme == "tensor" else (96,))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, exact = module(x).float(), linear(x).float()
    assert (out - exact).norm() / exact.norm() < 0.15
    status = prepare_ar_proxies(copy.deepcopy(tiny_model), "fp8", reference=True, fp8_scheme=scheme)
    assert status["fp8_scheme"] == scheme and status["kernel"] == "dequantize reference (fp32 matmul)"
    assert status["activations"] == f"float8_e4m3fn, dynamic per {'tensor' if scheme == 'tensor' else 'token'}"
    with pytest.raises(ValueError, match="fp8_scheme must be one of"):
        prepare_ar_proxies(copy.deepcopy(tiny_model), "fp8", reference=True, fp8_scheme="block")


def test_per_tensor_is_the_default_fp8_scheme_and_differs_from_row_wise():
    linear = make_linear(96, 128, seed=8)
    assert FP8Linear.from_linear(linear).scheme == "tensor"
    tensor, channel = (FP8Linear.from_linear(linear, reference=True, scheme=s) for s in ("tensor", "channel"))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert not torch.equal(tensor(x), channel(x))


def test_int8_proxies_are_declined_on_accelerators_without_a_kernel(monkeypatch):
    import yue2_vllm.model.torch_quant as tq

    monkeypatch.setattr(tq, "int8pack_available", lambda device, dtype: False)
    reason = proxy_slow_reason("int8", "cuda:0", torch.bfloat16)
    assert reason.startswith("int8 proxies on CUDA have no _weight_int8pack_mm kernel for bfloat16")
    assert "quantized_policy 'force'" in reason
    assert proxy_slow_reason("int8", "cpu") is None  # the CPU keeps its dequantising fallback
    assert proxy_slow_reason("fp8", "cuda:0") is None and proxy_slow_reason("none", "cuda:0") is None
    monkeypatch.setattr(tq, "int8pack_available", lambda device, dtype: True)
    assert proxy_slow_reason("int8", "mps") is None


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_fp8_scaled_mm_call_matches_reference_where_cpu_torch_has_it(scheme):
    # The CUDA path's exact _scaled_mm call (rows padded to 16, per-tensor or row-wise fp32 scales,
    # column-major weight); CPU torch 2.13 accepts the same call, which checks the arguments without a GPU.
    linear = make_linear(96, 128, seed=6)
    module = FP8Linear.from_linear(linear, scheme=scheme)
    reference = FP8Linear.from_linear(linear, reference=True, scheme=scheme)
    x = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    try:
        out = module._scaled_mm(x.reshape(-1, 128))
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no CPU _scaled_mm here: {exc}")
    assert out.shape == (14, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x).reshape(14, 96).float(), atol=1e-2, rtol=1e-2)


def test_int8_checkpoint_loads_in_float32(int8_dir, int8_model):
    model = load_model(int8_dir, dtype=torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.int8 and q_proj.weight_scale.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32
    logits = model.forward_ar(torch.tensor([PROMPT]))
    assert logits.dtype == torch.float32
    expected = int8_model.forward_ar(torch.tensor([PROMPT])).float()
    assert (logits - expected).abs().max() < 0.1


def test_int8_checkpoint_models_have_no_proxies_or_originals(int8_model):
    with pytest.raises(ValueError, match="already quantized"):
        prepare_ar_proxies(int8_model, "int8")
    with pytest.raises(ValueError, match="no bf16 originals to restore"):
        restore_ar(int8_model)


def test_bf16_load_status(tiny_model):
    assert tiny_model.quantization_status == {"mode": "none", "source": None, "active_ar_linears": 0,
                                              "restorable": False}
    assert len(AR_LINEARS) == 7 and len(ar_linear_names(28)) == 196


# --------------------------------------------------------------------------- memory budget and imports


def test_memory_cap_numbers_and_refusals():
    assert memory_cap(24, 80 * GIB) == 22 * GIB
    assert memory_cap(24, 16 * GIB) == 14 * GIB
    assert memory_cap(24, 80 * GIB, reserve_gib=4) == 20 * GIB
    assert memory_cap(8, 80 * GIB, model_bytes=6 * GIB) == 6 * GIB
    with pytest.raises(ValueError, match=r"memory budget 2 GiB on a device of 80.00 GiB leaves 0.00 GiB usable"):
        memory_cap(2, 80 * GIB)
    with pytest.raises(ValueError, match=r"leaves 4.00 GiB usable .* cannot hold the model's 6.80 GiB"):
        memory_cap(6, 80 * GIB, model_bytes=int(6.8 * GIB))
    with pytest.raises(ValueError, match="must be positive"):
        memory_cap(0, 80 * GIB)
    assert apply_memory_cap("cpu", 3, model_bytes=GIB) == GIB
    with pytest.raises(ValueError, match="cannot hold"):
        apply_memory_cap("cpu", 3, model_bytes=2 * GIB)


@pytest.mark.parametrize("device,index", [("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_memory_cap_goes_to_the_indexed_cuda_device(monkeypatch, device, index):
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    assert apply_memory_cap(device, 24, model_bytes=GIB) == 22 * GIB
    assert calls == [(22 / 80, index)]  # an int index: torch refuses an unindexed torch.device("cuda")


def test_import_pulls_in_no_vllm_triton_or_llmcompressor():
    code = ("import sys, yue2_vllm.model.torch_quant; "
            "print(sorted(m for m in ('vllm', 'triton', 'llmcompressor') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
