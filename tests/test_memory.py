"""The device split between the engine and the torch side, at the released YuE2-3B size."""
import pytest

from yue2_vllm.memory import (GIB, ar_expert_bytes, kv_cache_bytes, nar_chunk_bytes, plan_memory, row_kv_bytes,
                              torch_decode_bytes)
from yue2_vllm.model.modeling import YuE2Config
from yue2_vllm.testing import TINY_CONFIG

FULL = YuE2Config()
MOT, AR_BF16, AR_FP8, VAE = int(6.76 * GIB), int(4.03 * GIB), int(2.92 * GIB), int(0.25 * GIB)


def test_kv_arithmetic():
    assert kv_cache_bytes(FULL) == 2.625 * GIB and kv_cache_bytes(FULL, 2) == 5.25 * GIB
    assert kv_cache_bytes(FULL, dtype_bytes=4) == 5.25 * GIB
    assert row_kv_bytes(FULL, 100, 16) == 112 * 16 * 1024 * 7  # 7 blocks of 16 tokens, 112 KiB a token
    assert ar_expert_bytes(FULL) == 2 * (2 * 184704 * 2048 + 2048 + 28 * (2 * 2048 * 2048 + 2 * 1024 * 2048
                                                                          + 3 * 6144 * 2048 + 2 * 128 + 2 * 2048))


def test_h200_split_defaults_to_many_rows_and_states_its_share():
    from yue2_vllm.memory import ar_host_bytes, nar_song_bytes

    plan = plan_memory(FULL, device="cuda", budget_gib=80, engine_weights=AR_BF16, torch_model=MOT, vae=VAE,
                       total=int(139 * GIB))
    # One AR copy on the card (the engine's): ours waits in host memory; room for one song's buffers, no
    # reserved torch-backend K/V (a torch song is admitted into the room when it starts).
    assert not plan.ar_on_device and plan.ar_host == ar_host_bytes(FULL) and plan.torch_model == MOT - plan.ar_host
    assert plan.song_room == nar_song_bytes(FULL, [2048 + 9000], streamed=True) and plan.torch_decode == 0
    fixed = AR_BF16 + 2 * GIB + plan.torch_model + VAE + plan.song_room + 2 * GIB
    rows = (80 * GIB - fixed) // row_kv_bytes(FULL, 2048 + 9000, 16)
    assert plan.problems() == [] and plan.max_num_seqs == rows == 56
    assert plan.kv_cache == 56 * row_kv_bytes(FULL, 2048 + 9000, 16) + 2 * 16 * 112 * 1024
    assert plan.resident + plan.song_room <= plan.limit and plan.room >= plan.song_room
    assert plan.engine == AR_BF16 + plan.kv_cache + 2 * GIB
    assert plan.gpu_memory_utilization == pytest.approx(plan.engine / (139 * GIB))
    assert plan.engine + plan.torch_side <= 80 * GIB


def test_torch_decode_counts_both_branches_kv_rows_and_one_step():
    # A CFG pair of 11,048-token rows at 112 KiB a token, plus activations and fp32 sampling rows (< 8 MiB).
    kv = 2 * 11048 * 112 * 1024
    assert kv < torch_decode_bytes(FULL, 11048) < kv + 8 * 2**20
    assert torch_decode_bytes(FULL, 11048, branches=1) < torch_decode_bytes(FULL, 11048) / 1.9


def test_24gb_card_is_refused_by_name_when_asked_for_too_many_full_rows():
    explicit = dict(device="cuda", budget_gib=24, torch_model=MOT, vae=VAE, total=24 * GIB, max_num_seqs=8,
                    kv_cache=8 * kv_cache_bytes(FULL))
    refused = plan_memory(FULL, engine_weights=AR_BF16, **explicit)
    (problem,) = refused.problems()
    assert "KV cache for 8 rows" in problem and "--concurrency" in problem and "FP8" in problem
    assert "--offload-ar" not in problem and "host memory" in problem  # the AR expert is off the card already
    assert "(bf16 K/V)" in problem and "--kv-cache-dtype fp8 halves it" in problem
    fp8_kv = plan_memory(FULL, engine_weights=AR_BF16, kv_dtype_bytes=1, **explicit)  # what was asked, in FP8
    assert "(FP8 K/V)" in fp8_kv.problems()[0] and "--kv-cache-dtype" not in fp8_kv.problems()[0]
    with pytest.raises(MemoryError, match="the budget allows 24.00 GiB"):
        refused.check()
    fitted = plan_memory(FULL, device="cuda", budget_gib=24, engine_weights=AR_BF16, torch_model=MOT, vae=VAE,
                         total=24 * GIB)
    assert fitted.problems() == [] and fitted.max_num_seqs >= 4
    assert nar_chunk_bytes(FULL, offload_ar=True) < nar_chunk_bytes(FULL)


def test_tiny_cpu_plan_is_small():
    plan = plan_memory(TINY_CONFIG, device="cpu", budget_gib=24, engine_weights=95 * 2**20, torch_model=100 * 2**20,
                       typical_tokens=2300, total=24 * GIB)
    assert plan.max_num_seqs == 16 and plan.kv_cache < 64 * 2**20 and plan.gpu_memory_utilization is None
    assert plan.kv_cache >= row_kv_bytes(TINY_CONFIG, 24576, 128)  # any single request can be admitted


def test_vae_tile_working_set_is_the_widest_stage():
    from yue2_vllm.memory import vae_decode_bytes
    from yue2_vllm.model.vae import VAEConfig

    # Release decoder: the last stage, 64 channels x 1920 samples per frame, 4 live fp32 tensors.
    assert vae_decode_bytes(VAEConfig(), 1024, 16) == 4 * 4 * 64 * 1920 * 1056
    assert vae_decode_bytes(VAEConfig(), 512, 16) == 4 * 4 * 64 * 1920 * 544
    with pytest.raises(ValueError, match="core_frames must be >= 1"):
        vae_decode_bytes(VAEConfig(), 0, 16)


def test_total_memory_of_an_indexed_gpu(monkeypatch):
    from types import SimpleNamespace

    import torch

    from yue2_vllm.memory import total_memory_bytes

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=(i + 1) * GIB))
    assert total_memory_bytes("cuda") == GIB and total_memory_bytes("cuda:1") == 2 * GIB


# ---------------------------------------------------------------- unified memory (DGX Spark's GB10) vs discrete
from conftest import write_meminfo  # noqa: E402

from yue2_vllm.memory import (ROW_CAP, UNIFIED_HOST_BYTES, budget_problem, default_budget_gib, device_pool,  # noqa: E402
                              os_reserve_bytes, read_meminfo)

TYPICAL = row_kv_bytes(FULL, 2048 + 9000, 16)  # one default song's KV on CUDA
MARGIN = 2 * 16 * 112 * 1024


def release_plan(budget_gib, total, **extra):
    return plan_memory(FULL, device="cuda", budget_gib=budget_gib, engine_weights=AR_BF16, torch_model=MOT, vae=VAE,
                       total=total, **extra)


def test_meminfo_is_read_in_bytes(tmp_path):
    path = write_meminfo(tmp_path / "meminfo", int(119.7 * GIB), 100 * GIB)
    info = read_meminfo(path)
    assert info["MemTotal"] == int(119.7 * GIB) // 1024 * 1024 and info["MemAvailable"] == 100 * GIB
    assert info["HugePages_Total"] == 0  # a count, not kB
    assert os_reserve_bytes(16 * GIB) == 8 * GIB and os_reserve_bytes(200 * GIB) == 20 * GIB


def test_gb10_plans_one_pool_from_memavailable(fake_gpu, tmp_path):
    gpu = fake_gpu("GB10")
    meminfo = write_meminfo(tmp_path / "meminfo", gpu["total"], 100 * GIB)
    pool = device_pool("cuda", meminfo)
    mem_total = read_meminfo(meminfo)["MemTotal"]
    reserve = max(8 * GIB, int(0.10 * mem_total))  # the documented rule: 8 GiB or 10 %, the larger
    assert (pool.mem_available, pool.reserve, pool.pool) == (100 * GIB, reserve, 100 * GIB - reserve)
    assert pool.device_free == gpu["free"] < pool.mem_available  # cudaMemGetInfo under-reports: shown, not used
    assert default_budget_gib(pool) == pool.pool / GIB and default_budget_gib(None, host=64 * GIB) == 24.0
    plan = release_plan(default_budget_gib(pool), gpu["total"], unified=pool)
    host = 3 * GIB + 2 * GIB
    assert plan.host_side == host == sum(UNIFIED_HOST_BYTES.values()) and plan.limit == pool.pool
    fixed = AR_BF16 + 2 * GIB + MOT + VAE + plan.nar_chunks + 2 * GIB + host + plan.torch_decode
    rows = min(ROW_CAP["cuda"], (pool.pool - fixed) // TYPICAL)
    assert plan.max_num_seqs == rows and plan.kv_cache == rows * TYPICAL + MARGIN
    assert plan.problems() == [] and plan.engine + plan.torch_side + plan.host_side <= pool.pool
    assert plan.gpu_memory_utilization == pytest.approx(plan.engine / gpu["total"])
    described = plan.describe()
    assert described["unified_memory"] and described["unified"]["pool"] == pool.pool
    # vLLM's start-up check on an integrated GPU: utilization x total against MemAvailable after its own process.
    assert plan.startup_problem(100 * GIB) is None
    short = plan.engine + 3 * GIB - GIB
    assert "MemAvailable is" in plan.startup_problem(short) and "--concurrency" in plan.startup_problem(short)


def test_gb10_refuses_a_budget_above_the_pool_and_a_split_it_cannot_hold(fake_gpu, tmp_path):
    gpu = fake_gpu("GB10")
    pool = device_pool("cuda:0", write_meminfo(tmp_path / "meminfo", gpu["total"], 30 * GIB))
    problem = budget_problem(100, pool)
    assert f"{pool.pool / GIB:.2f} GiB" in problem and "--budget 100.00 GiB" in problem and "MemAvailable" in problem
    assert budget_problem(pool.pool / GIB, pool) is None and budget_problem(100, None) is None
    empty = device_pool("cuda", write_meminfo(tmp_path / "empty", gpu["total"], 8 * GIB))
    assert empty.pool == 0 and "nothing is left to plan with" in budget_problem(default_budget_gib(empty), empty)
    refused = release_plan(24, gpu["total"], unified=pool, max_num_seqs=8, kv_cache=8 * kv_cache_bytes(FULL))
    (problem,) = refused.problems()
    assert "MemAvailable is 30.00 GiB" in problem and "need" in problem and "--concurrency" in problem
    with pytest.raises(MemoryError, match="unified memory"):
        refused.check()


@pytest.mark.parametrize("name", ["B200", "H100", "L40S"])
def test_discrete_gpus_plan_against_their_card(fake_gpu, tmp_path, name):
    from yue2_vllm.memory import DEVICE_RESERVE_FRACTION, total_memory_bytes

    gpu = fake_gpu(name)
    assert device_pool("cuda", write_meminfo(tmp_path / "meminfo", 64 * GIB, 10 * GIB)) is None
    card = total_memory_bytes("cuda")
    assert card == gpu["total"] and default_budget_gib(None, card) == pytest.approx(0.9 * card / GIB)
    assert DEVICE_RESERVE_FRACTION == 0.10 and default_budget_gib(None, host=64 * GIB) == 24.0  # the CPU's rule
    plan = release_plan(default_budget_gib(None, card), gpu["total"])
    assert plan.unified is None and plan.host_side == 0 and plan.startup_problem(0) is None
    fixed = AR_BF16 + 2 * GIB + plan.torch_model + VAE + plan.song_room + 2 * GIB
    rows = min(ROW_CAP["cuda"], (int(0.9 * card) - fixed) // TYPICAL)
    assert plan.max_num_seqs == rows and plan.limit == int(0.9 * card) and plan.problems() == []
    # A budget caps; one above the card is refused naming both figures and what to lower.
    assert release_plan(24, gpu["total"]).limit == 24 * GIB
    problem = budget_problem(card / GIB + 1, None, card)
    assert f"above this GPU's {card / GIB:.2f} GiB" in problem and "lower --budget" in problem
    assert budget_problem(card / GIB, None, card) is None


def test_the_cpu_plan_ignores_unified_memory(tmp_path):
    from yue2_vllm.memory import unified_pool

    assert device_pool("cpu") is None
    pool = unified_pool(write_meminfo(tmp_path / "meminfo", 64 * GIB, 10 * GIB))
    args = dict(device="cpu", budget_gib=24, engine_weights=95 * 2**20, torch_model=100 * 2**20, typical_tokens=2300,
                total=24 * GIB)
    plan = plan_memory(TINY_CONFIG, unified=pool, **args)  # host memory is the budget there already
    assert plan == plan_memory(TINY_CONFIG, **args) and plan.unified is None and plan.host_side == 0


# ---------------------------------------------------------------- real weights on the cards users have (issue 32)
import json  # noqa: E402
import math  # noqa: E402

from yue2_vllm.memory import (CARDS_MIB, card_table, card_table_markdown, vae_decode_bytes,  # noqa: E402
                              w8a8_ar_bytes)
from yue2_vllm.model.modeling import tensor_shapes  # noqa: E402
from yue2_vllm.model.vae import VAEConfig, decoder_bytes  # noqa: E402

REAL_MOT = 2 * sum(math.prod(shape) for shape in tensor_shapes(FULL).values())  # all bf16, as released
REAL_VAE_FILE = int(0.494 * GIB)  # the released VAE file: encoder + decoder, fp32
# (AR form, KV form) -> the least rows each card serves with default flags; the FP8 KV goals are issue 39's.
GOAL = {"RTX 4080/5080 16 GB": {("FP8", "bf16"): 2, ("bf16", "FP8"): 1}, "L4 24 GB": {("bf16", "bf16"): 4,
                                                                                       ("bf16", "FP8"): 12},
        "RTX 4090 24 GB": {("bf16", "bf16"): 4, ("bf16", "FP8"): 12}, "RTX 5090 32 GB": {("bf16", "bf16"): 8},
        "L40S 48 GB": {("bf16", "bf16"): 16}, "H100 80 GB": {("bf16", "bf16"): 40, ("bf16", "FP8"): 90},
        "H200 141 GB": {("bf16", "bf16"): 64, ("bf16", "FP8"): 128},
        "GB10 (DGX Spark), MemAvailable 110 GiB": {("bf16", "bf16"): 32}}


def real_table():
    return card_table(FULL, mot_bytes=REAL_MOT, vae_bytes=decoder_bytes(VAEConfig()),
                      vae_tile=vae_decode_bytes(VAEConfig(), 1024, 16),
                      ar_forms={"bf16": ar_expert_bytes(FULL), "FP8": w8a8_ar_bytes(FULL)},
                      kv_forms={"bf16": 2, "FP8": 1})


def table_row(card: str, ar: str = "bf16", kv: str = "bf16") -> dict:
    return next(row for row in real_table() if (row["card"], row["ar"], row["kv"]) == (card, ar, kv))


def test_the_fp8_checkpoint_size_is_the_published_layouts():
    from yue2_vllm.quant.export import expected_layout

    sizes = {"BF16": 2, "F8_E4M3": 1}
    layout = expected_layout(FULL, "F8_E4M3")
    assert w8a8_ar_bytes(FULL) == sum(sizes[d] * math.prod(s) for d, s in layout.values()) == 2_923_776_000


def test_card_table_meets_the_goal_and_every_plan_adds_up_within_its_card():
    rows = real_table()
    by = {(row["card"], row["ar"], row["kv"]): row for row in rows}
    for card, goals in GOAL.items():
        for (form, kv), least in goals.items():
            assert by[card, form, kv]["rows"] >= least, (card, form, kv, by[card, form, kv]["rows"])
    # Memory bounds every row below the cap (vLLM's CUDA default of 256 rows); FP8 K/V doubles each card's rows.
    assert max(row["rows"] for row in rows) < ROW_CAP["cuda"] == 256
    for card in GOAL:
        for form in ("bf16", "FP8"):
            bf16_kv, fp8_kv = by[card, form, "bf16"]["rows"], by[card, form, "FP8"]["rows"]
            assert 2 * bf16_kv <= fp8_kv <= 2 * bf16_kv + 3 or not bf16_kv, (card, form, bf16_kv, fp8_kv)
            assert by[card, form, "FP8"]["plan"].kv_dtype_bytes == 1
    for row in rows:
        plan = row["plan"]
        parts = (plan.engine_weights + plan.kv_cache + plan.engine_overhead + plan.torch_model + plan.vae
                 + plan.nar_chunks + plan.torch_decode + plan.song_room + plan.torch_reserve + plan.host_side)
        card = plan.total if plan.unified is None else plan.unified.pool
        if row["rows"]:
            assert parts == row["need"] <= plan.limit <= card, row["card"]
            # any single full-context request can be admitted
            assert plan.kv_cache >= kv_cache_bytes(FULL, dtype_bytes=plan.kv_dtype_bytes)
            if plan.unified is None:
                assert plan.limit == int(0.9 * plan.total) and plan.room >= plan.song_room
    # 16 GB with the bf16 AR: refused, truthfully. One AR copy, one full context of KV, one song's room:
    short = by["RTX 4080/5080 16 GB", "bf16", "bf16"]
    assert short["rows"] == 0 and 1.1 * GIB < short["need"] - short["limit"] < 1.25 * GIB
    # ... and with FP8 K/V it serves: one full context of KV is 1.31 GiB instead of 2.63.
    fits = by["RTX 4080/5080 16 GB", "bf16", "FP8"]
    assert fits["rows"] == 2 and fits["plan"].kv_cache >= kv_cache_bytes(FULL, dtype_bytes=1)
    assert short["need"] - fits["need"] == kv_cache_bytes(FULL) - kv_cache_bytes(FULL, dtype_bytes=1) + MARGIN // 2
    # GB10 keeps its one-pool rules: the AR expert stays resident there (one pool: host memory is the device).
    assert by["GB10 (DGX Spark), MemAvailable 110 GiB", "bf16", "bf16"]["plan"].ar_on_device


def test_the_card_table_in_docs_memory_is_the_plan_codes():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text(encoding="utf-8")
    assert card_table_markdown(real_table()) in page


def test_resident_bytes_per_placement_counted_on_the_meta_device():
    import torch

    from yue2_vllm.model.modeling import YuE2Model
    from yue2_vllm.model.placement import weight_homes
    from yue2_vllm.model.vae import OobleckDecoder, _decoder_kwargs

    with torch.device("meta"):
        model = YuE2Model(FULL)
        decoder = OobleckDecoder(**_decoder_kwargs(VAEConfig()))
    homes = weight_homes(FULL, ar_on_device=False)
    counted = {"host": 0, "device": 0}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        counted[homes.get(name, "device")] += tensor.numel() * 2  # bf16, as released and loaded
    plan = table_row("L4 24 GB")["plan"]
    assert counted["host"] + counted["device"] >= REAL_MOT
    assert plan.ar_host == counted["host"] and plan.torch_model == REAL_MOT - counted["host"]
    assert counted["host"] == ar_expert_bytes(FULL) - 2 * 2048  # all of the AR expert but the final norm
    from yue2_vllm.memory import ar_layer_bytes

    assert ar_layer_bytes(FULL) == 2 * (2 * 2048 * 2048 + 2 * 1024 * 2048 + 3 * 6144 * 2048 + 2 * 2048 + 2 * 128)
    assert counted["device"] - plan.torch_model < 2**20  # the rest: buffers (RoPE-free model: tiny) only
    assert plan.vae == sum(t.numel() * 4 for t in decoder.parameters()) < REAL_VAE_FILE


def sparse_release(tmp_path):
    """The released directories' config files with sparse weight files of the real sizes (the plan reads sizes)."""
    from dataclasses import asdict

    model, vae = tmp_path / "YuE2-3B", tmp_path / "YuE2-Vae"
    for directory, config, size in ((model, asdict(FULL), REAL_MOT), (vae, VAEConfig().to_dict(), REAL_VAE_FILE)):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        with open(directory / "model.safetensors", "wb") as handle:
            handle.truncate(size)
    return model, vae


@pytest.mark.parametrize("card", list(CARDS_MIB))
def test_patched_cards_plan_the_release_as_the_table_says(fake_gpu, tmp_path, monkeypatch, card):
    from yue2_vllm.cli.setup import memory_plan
    from yue2_vllm.options import EngineOptions

    fake_gpu("H100", total=CARDS_MIB[card] * 2**20)
    monkeypatch.setattr("yue2_vllm.memory.MEMINFO", str(write_meminfo(tmp_path / "meminfo", 64 * GIB, 60 * GIB)))
    model, vae = sparse_release(tmp_path)
    plan = memory_plan(model, vae, "cuda")
    row = table_row(card)
    assert plan == row["plan"] and plan.engine + plan.torch_side <= plan.total
    fp8 = memory_plan(model, vae, "cuda", engine=EngineOptions(kv_cache_dtype="fp8"))  # the flag's plan: FP8 KV
    assert fp8 == table_row(card, kv="FP8")["plan"] and fp8.kv_dtype_bytes == 1


def test_a_patched_gb10_plans_the_release_in_its_pool(fake_gpu, tmp_path, monkeypatch):
    from yue2_vllm.cli.setup import memory_plan
    from yue2_vllm.memory import GB10_MEMINFO

    gpu = fake_gpu("GB10", total=GB10_MEMINFO["MemTotal"])
    meminfo = write_meminfo(tmp_path / "meminfo", GB10_MEMINFO["MemTotal"], GB10_MEMINFO["MemAvailable"])
    monkeypatch.setattr("yue2_vllm.memory.MEMINFO", str(meminfo))
    model, vae = sparse_release(tmp_path)
    plan = memory_plan(model, vae, "cuda")
    row = table_row("GB10 (DGX Spark), MemAvailable 110 GiB")
    assert plan.max_num_seqs == row["rows"] >= 32
    assert plan.unified.pool == row["plan"].unified.pool and plan.total == gpu["total"]
    assert plan.engine + plan.torch_side + plan.host_side <= plan.unified.pool


def test_the_cpu_default_budget_stays_inside_the_machine():
    from yue2_vllm.memory import DEFAULT_BUDGET_GIB, total_memory_bytes

    assert default_budget_gib(None, host=int(23.5 * GIB)) == pytest.approx(0.9 * 23.5)  # this project's machines
    assert default_budget_gib(None, host=256 * GIB) == DEFAULT_BUDGET_GIB == 24.0
    assert default_budget_gib(None) * GIB <= total_memory_bytes("cpu")


def test_the_16gb_card_shows_its_margin_and_plans_the_same_rows_without_a_vae_config(fake_gpu, tmp_path, monkeypatch):
    """The FP8-KV plan on a 16 GB card leaves a margin the table and `doctor` show; a VAE directory without its
    config.json (a download in progress, a Ray head) is planned as the release's VAE, not by its file size."""
    from yue2_vllm.cli.setup import memory_plan
    from yue2_vllm.options import EngineOptions

    row = table_row("RTX 4080/5080 16 GB", kv="FP8")
    assert row["rows"] == 2 and row["margin"] == row["limit"] - row["need"] == row["plan"].margin > 0
    assert row["plan"].describe()["margin_bytes"] == row["margin"]
    assert f"(margin {row['margin'] / GIB:.2f} GiB)" in row["plan"].describe()["summary"]
    assert table_row("RTX 4080/5080 16 GB")["margin"] < 0  # the bf16-KV plan: short, by that much
    fake_gpu("L40S", total=CARDS_MIB["RTX 4080/5080 16 GB"] * 2**20)
    monkeypatch.setattr("yue2_vllm.memory.MEMINFO", str(write_meminfo(tmp_path / "meminfo", 64 * GIB, 60 * GIB)))
    model, vae = sparse_release(tmp_path)
    with_config = memory_plan(model, vae, "cuda", engine=EngineOptions(kv_cache_dtype="fp8"))
    (vae / "config.json").unlink()
    without = memory_plan(model, vae, "cuda", engine=EngineOptions(kv_cache_dtype="fp8"))
    assert without == with_config == row["plan"] and without.problems() == []


def real_adapter_table():
    from yue2_vllm.memory import adapter_card_table

    return adapter_card_table(FULL, mot_bytes=REAL_MOT, vae_bytes=decoder_bytes(VAEConfig()),
                              vae_tile=vae_decode_bytes(VAEConfig(), 1024, 16),
                              ar_forms={"bf16": ar_expert_bytes(FULL), "FP8": w8a8_ar_bytes(FULL)})


def test_lora_slots_cost_rows_and_the_adapter_table_in_docs_memory_is_the_plan_codes():
    from pathlib import Path

    from yue2_vllm.memory import adapter_card_table_markdown

    rows = real_adapter_table()
    by = {(row["card"], row["ar"], row["adapters"]): row for row in rows}
    for (card, form, count), row in by.items():
        plan = row["plan"]
        assert plan.lora_slots == count * 139_460_608 and plan.engine == (plan.engine_weights + plan.lora_slots
                                                                         + plan.kv_cache + plan.engine_overhead)
        if count:  # slots only ever take rows away, never add them
            assert row["rows"] <= by[card, form, 0]["rows"]
    assert by["L4 24 GB", "bf16", 4]["rows"] < by["L4 24 GB", "bf16", 0]["rows"]
    page = (Path(__file__).resolve().parents[1] / "docs" / "memory.md").read_text(encoding="utf-8")
    assert adapter_card_table_markdown(rows) in page
