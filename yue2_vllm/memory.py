"""The memory budget: how one device is split between the vLLM engine and the torch side.

The engine holds the AR checkpoint and the KV cache for its rows; on the CPU and on unified memory the
torch side holds the whole bf16 MoT (the NAR's prefix prefill runs the AR expert), the fp32 VAE, and one
NAR chunk's buffers per song the synthesis lane runs at once (a discrete GPU: below). `plan_memory` sizes
the engine's rows and KV cache from what is left of the budget, and `MemoryPlan.check` refuses, naming
every part, a split that cannot fit. On CUDA the engine's share becomes its `gpu_memory_utilization` and
`kv_cache_memory_bytes`; on the CPU both sides live in host memory under the same budget.

On a discrete GPU (the engine serves the AR half) the torch side holds the AR expert once: the engine's copy
serves the AR phases, ours stays in pinned host memory (`ar_on_device` False) and the NAR's prefix prefill
streams it to the device one layer at a time (`model.placement`); the device keeps the NAR expert, the
shared tensors and the VAE. Per-song buffers are not reserved for every row: the plan keeps `song_room` for
the buffers of one song (its NAR prefix K/V and activations, or one VAE tile), which the synthesis lane and
the decoder admit against (`room.DeviceRoom`); a torch-backend song there gets the AR expert and its K/V from
the same room when it starts. The default budget is the card less `DEVICE_RESERVE_FRACTION` (vLLM's
`gpu_memory_utilization` default of 0.9 leaves the same tenth).

On unified memory (an integrated GPU such as DGX Spark's GB10: CPU and GPU share one LPDDR pool, and
`total_memory` is the machine's RAM) the plan is one budget for host and device: the pool is
`MemAvailable` (/proc/meminfo) less an OS reserve (`os_reserve_bytes`: at least 8 GiB or 10 % of
MemTotal), the default budget is that pool, and the split also counts the host side of the engine
process and of ours (`UNIFIED_HOST_BYTES`), which would otherwise double-book the same memory.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from .model.modeling import YuE2Config, ar_streamed_shapes, ar_tensor_shapes
from .protocol import CONTEXT

GIB = 2**30
TORCH_RESERVE_BYTES = 2 * GIB  # allocator slack and temporaries on the torch side
# The engine's bytes beyond its weights and KV cache: Python, torch, vLLM, activations, sampler, CUDA graphs and
# context. The CPU's is measured: the worker of a release-size engine (random weights, 2 rows) held 2.19 GiB
# (bf16 K/V) and 2.21 GiB (FP8 K/V) beyond them once started (`yue2-vllm bench --model release-size --paths
# engine-memory,engine-memory-fp8`, docs/memory.md). CUDA's is not measured yet (bench/gpu_check.py engine.kv_cache).
ENGINE_OVERHEAD_BYTES = {"cpu": int(2.4 * GIB), "cuda": 2 * GIB}
# While vLLM-CPU loads the weights, the checkpoint file's pages stay mapped beside the copy it makes: the worker's
# peak at start is twice the weights plus this (0.58 GiB measured, FP8 K/V, where loading was the peak).
ENGINE_LOAD_BYTES = {"cpu": int(0.75 * GIB)}
# KV block size we start the engine with: vLLM's CUDA default; on the CPU the smallest its attention kernel
# takes (vLLM-CPU defaults to 128), so prefix caching keeps all but < 32 tokens of a warmed CFG prompt.
KV_BLOCK_TOKENS = {"cpu": 32, "cuda": 16}
KV_MARGIN_BLOCKS = 2  # vLLM keeps a block back; allot two beyond what the rows need
# Default rows at most: more do not pay on 2–16 CPU cores; on CUDA vLLM's own default max_num_seqs (256, the
# batch its CUDA-graph capture sizes and scheduler defaults are made for). Below the cap memory bounds the rows.
ROW_CAP = {"cpu": 16, "cuda": 256}
PROMPT_ESTIMATE_TOKENS = 2048  # a song's prompt (text + ABC) for default sizing; admission uses the real one
DEFAULT_BUDGET_GIB = 24.0  # --budget on the CPU when none is given, within the host less 10 % (a GPU: its card or pool)
DEVICE_RESERVE_FRACTION = 0.10  # a discrete GPU's default budget is the card less this (vLLM's 0.9 default)
MEMINFO = "/proc/meminfo"
OS_RESERVE_MIN_BYTES = 8 * GIB  # unified memory: kept for the OS, page cache and other processes ...
OS_RESERVE_FRACTION = 0.10  # ... or 10 % of MemTotal, whichever is larger
# Unified memory: host bytes that come out of the same pool. The engine process: Python, torch, vLLM and its
# imports, the CUDA context, pinned staging buffers (~3 GiB); ours: Python, torch, tokenizer, song buffers.
UNIFIED_HOST_BYTES = {"engine_process": 3 * GIB, "pipeline_process": 2 * GIB}


def kv_bytes_per_token(config: YuE2Config, dtype_bytes: int = 2) -> int:
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


def kv_cache_bytes(config: YuE2Config, max_sequences: int = 1, context: int = CONTEXT, block_size: int = 16,
                   dtype_bytes: int = 2) -> int:
    """KV cache of `max_sequences` sequences of `context` tokens: 2.625 GiB for one full bf16 YuE2 context."""
    return math.ceil(context / block_size) * block_size * max_sequences * kv_bytes_per_token(config, dtype_bytes)


def total_memory_bytes(device_type: str) -> int:
    """The device's bytes: `cuda` is the current GPU, `cuda:N` GPU N; anything else is host memory."""
    if device_type.startswith("cuda"):
        import torch

        index = int(device_type.partition(":")[2] or torch.cuda.current_device())
        return torch.cuda.get_device_properties(index).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_meminfo(path: str | os.PathLike | None = None) -> dict[str, int]:
    """/proc/meminfo (or `path`) as `{field: bytes}` (kB figures times 1024; counts without a unit as they are)."""
    values = {}
    with open(path or MEMINFO, encoding="ascii") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if name and parts and parts[0].isdigit():
                values[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return values


def os_reserve_bytes(mem_total: int) -> int:
    """What a unified-memory plan leaves to the OS: at least 8 GiB, or 10 % of MemTotal when that is more."""
    return max(OS_RESERVE_MIN_BYTES, int(OS_RESERVE_FRACTION * mem_total))


@dataclass(frozen=True)
class UnifiedPool:
    """The one pool an integrated GPU shares with the host, as /proc/meminfo tells it (bytes)."""

    mem_total: int
    mem_available: int
    reserve: int
    device_free: int | None = None  # cudaMemGetInfo's free figure (under-reports here; shown, not used)

    @property
    def pool(self) -> int:
        """What the split may use: MemAvailable less the OS reserve."""
        return max(0, self.mem_available - self.reserve)

    def describe(self) -> dict:
        return {"unified_memory": True, "mem_total": self.mem_total, "mem_available": self.mem_available,
                "os_reserve": self.reserve, "pool": self.pool, "device_free": self.device_free,
                "summary": f"pool {_gib(self.pool)} = MemAvailable {_gib(self.mem_available)} - OS reserve "
                           f"{_gib(self.reserve)} (MemTotal {_gib(self.mem_total)})"}


def unified_pool(meminfo_path: str | os.PathLike | None = None, device_free: int | None = None) -> UnifiedPool:
    """The unified pool now: MemAvailable and MemTotal from `meminfo_path`, the reserve from MemTotal."""
    info = read_meminfo(meminfo_path)
    missing = [name for name in ("MemTotal", "MemAvailable") if name not in info]
    if missing:
        raise ValueError(f"{meminfo_path or MEMINFO}: no {' or '.join(missing)} line; cannot size a unified-memory "
                         "split")
    return UnifiedPool(info["MemTotal"], info["MemAvailable"], os_reserve_bytes(info["MemTotal"]), device_free)


def device_pool(device: str, meminfo_path: str | os.PathLike | None = None) -> UnifiedPool | None:
    """The unified pool when `device` (cuda, cuda:N) is an integrated GPU (`devices.unified_memory`), else None."""
    if not device.startswith("cuda"):
        return None
    import torch

    from .devices import unified_memory

    if not torch.cuda.is_available() or not unified_memory(device)[0]:
        return None
    free, _ = torch.cuda.mem_get_info(int(device.partition(":")[2] or torch.cuda.current_device()))
    return unified_pool(meminfo_path, device_free=int(free))


def split_limit(budget: int, total: int, unified: UnifiedPool | None) -> int:
    """What a split may use: the budget, within the device (and on unified memory, within the pool)."""
    return min(budget, total, unified.pool) if unified is not None else min(budget, total)


def default_budget_gib(pool: UnifiedPool | None, card: int | None = None, host: int | None = None) -> float:
    """--budget when none is given: the unified pool on an integrated GPU, a discrete GPU's `card` bytes less
    DEVICE_RESERVE_FRACTION, else (the CPU) DEFAULT_BUDGET_GIB within the machine: at most its `host` memory
    (default: this machine's) less the same tenth."""
    if pool is not None:
        return pool.pool / GIB
    if card is not None:
        return card * (1 - DEVICE_RESERVE_FRACTION) / GIB
    host = total_memory_bytes("cpu") if host is None else host
    return min(DEFAULT_BUDGET_GIB, host * (1 - DEVICE_RESERVE_FRACTION) / GIB)


def budget_problem(budget_gib: float, pool: UnifiedPool | None, card: int | None = None) -> str | None:
    """Why a --budget cannot be had: above the unified pool, or above a discrete GPU's `card` bytes, naming the
    figures; None when it can."""
    if pool is None:
        if card is not None and budget_gib * GIB > card:
            return (f"--budget {budget_gib:.2f} GiB is above this GPU's {_gib(card)}: lower --budget to "
                    f"{card / GIB:.2f} or less, or leave it out (default: the card less "
                    f"{DEVICE_RESERVE_FRACTION:.0%}, {card * (1 - DEVICE_RESERVE_FRACTION) / GIB:.2f} GiB)")
        return None
    if pool.pool <= 0:
        return (f"unified memory: MemAvailable {_gib(pool.mem_available)} is within the OS reserve of "
                f"{_gib(pool.reserve)}; nothing is left to plan with: free host memory")
    if budget_gib * GIB <= pool.pool:
        return None
    return (f"--budget {budget_gib:.2f} GiB is above the unified memory pool of {_gib(pool.pool)} (MemAvailable "
            f"{_gib(pool.mem_available)} less the OS reserve {_gib(pool.reserve)}); this GPU shares the host's "
            f"memory: lower --budget to {pool.pool / GIB:.2f} or less (or leave it out), or free host memory")


def ar_expert_bytes(config: YuE2Config) -> int:
    """bf16 bytes of the MoT's AR expert (embeddings, lm_head, the AR half of every layer)."""
    return 2 * sum(math.prod(shape) for shape in ar_tensor_shapes(config).values())


def ar_host_bytes(config: YuE2Config, dtype_bytes: int = 2) -> int:
    """Bytes of `ar_streamed_shapes` (4.03 GiB bf16 at YuE2-3B's size)."""
    return dtype_bytes * sum(math.prod(shape) for shape in ar_streamed_shapes(config).values())


def ar_layer_bytes(config: YuE2Config, dtype_bytes: int = 2) -> int:
    """One layer's AR half, the most a streamed prefill holds on the device at once (96 MiB bf16 at full size)."""
    shapes = ar_streamed_shapes(config)
    return dtype_bytes * sum(math.prod(shape) for name, shape in shapes.items() if name.startswith("model.layers.0."))


def nar_song_bytes(config: YuE2Config, chunk_tokens: list[int], streamed: bool = False) -> int:
    """Device bytes a NAR run of these chunks takes beyond the resident weights: every chunk's prefix K/V and
    activations (a batch prefills all its chunks before the ODE steps) and, streamed, one AR layer."""
    return sum(nar_chunk_bytes(config, tokens) for tokens in chunk_tokens) + (ar_layer_bytes(config) if streamed
                                                                               else 0)


def nar_chunk_bytes(config: YuE2Config, tokens: int = CONTEXT, offload_ar: bool = False) -> int:
    """Peak extra bytes of one NAR chunk: the prefix K/V kept for the ODE steps plus activations.

    With `offload_ar` the AR expert leaves the device after the prefix prefill, so the ODE steps'
    activations use its room (the prefill itself still runs beside the whole model).
    """
    activations = tokens * (3 * config.intermediate_size + 4 * config.hidden_size) * 2
    prefill = tokens * 4 * config.hidden_size * 2
    if offload_ar:
        activations = max(prefill, activations - ar_expert_bytes(config))
    return kv_bytes_per_token(config) * tokens + activations


def torch_decode_bytes(config: YuE2Config, tokens: int, branches: int = 2) -> int:
    """The torch AR phase's decode buffers: one K/V row of `tokens` (prompt + max_tokens) per CFG branch (what
    `BranchDecoder` and the eager caches allocate alike), plus the step's activations and fp32 sampling rows
    (the captured graph's pool holds one step's)."""
    step = branches * (4 * config.hidden_size + 3 * config.intermediate_size) + (branches + 4) * config.vocab_size
    return branches * tokens * kv_bytes_per_token(config) + 4 * step


VAE_ACTIVATION_COPIES = 4  # live [channels, samples] fp32 tensors in a residual unit: input, snake, conv, sum


def vae_decode_bytes(vae_config, core_frames: int, halo_frames: int) -> int:
    """Working set of one VAE tile (fp32 activations), the widest decoder stage times the tensors alive in it.

    A tile decodes `core + 2·halo` latent frames; stage k's activations are `widths[k] × frames ×
    prod(strides up to k)` floats (release: the last stage, 64 channels × 1920 samples per frame).
    """
    decoder = vae_config.decoder_config
    frames = core_frames + 2 * halo_frames
    if core_frames < 1 or halo_frames < 0:
        raise ValueError(f"core_frames must be >= 1 and halo_frames >= 0, got {core_frames}, {halo_frames}")
    widths = [decoder["channels"] * m for m in [1, *decoder["c_mults"]]]
    length, widest = frames, widths[-1] * frames
    for index in range(len(widths) - 1, 0, -1):  # block: widths[i] -> widths[i-1], upsampled by strides[i-1]
        length *= decoder["strides"][index - 1]
        widest = max(widest, widths[index - 1] * length)
    return 4 * VAE_ACTIVATION_COPIES * widest


@dataclass(frozen=True)
class MemoryPlan:
    """The split of one device's budget (bytes)."""

    device: str
    total: int
    budget: int
    engine_weights: int
    kv_cache: int
    engine_overhead: int
    torch_model: int
    vae: int
    nar_chunks: int
    torch_reserve: int
    max_num_seqs: int
    kv_block_tokens: int
    kv_dtype_bytes: int = 2  # one K/V element in the engine's cache: 2 bf16, 1 FP8 (kv_cache.element_bytes)
    host_side: int = 0  # unified memory: the engine process's and our host bytes, from the same pool
    unified: UnifiedPool | None = None
    torch_decode: int = 0  # the torch AR phase's K/V rows and graph pool (memory.torch_decode_bytes)
    ar_on_device: bool = True  # False: the torch side's AR expert lives in pinned host memory (discrete GPU)
    ar_host: int = 0  # those host bytes (not counted against the device)
    song_room: int = 0  # discrete GPU: room one song's buffers are admitted into (NAR or one VAE tile)
    lora_slots: int = 0  # the engine's LoRA buffers for AR adapters (lora_memory.lora_slots_bytes), model memory
    engine_load: int = 0  # the CPU: bytes beyond the weights the engine holds while loading them (the file's pages)

    @property
    def limit(self) -> int:
        """What the split may use: the budget, within the device (and on unified memory, within the pool)."""
        return split_limit(self.budget, self.total, self.unified)

    @property
    def engine(self) -> int:
        return self.engine_weights + self.lora_slots + self.kv_cache + self.engine_overhead

    @property
    def engine_peak(self) -> int:
        """The engine's most at once: running (weights, KV, overhead), or loading its weights where that holds
        more (the CPU: the mapped file beside the copy; LoRA slots are allocated as the model loads, counted in both)."""
        return max(self.engine, self.engine_weights + self.engine_load + self.lora_slots)

    @property
    def torch_side(self) -> int:
        return self.torch_model + self.vae + self.nar_chunks + self.torch_reserve + self.torch_decode + self.song_room

    @property
    def resident(self) -> int:
        """What stays on the device whatever the songs do: the engine, our weights and the reserve."""
        return self.engine_peak + self.torch_model + self.vae + self.torch_reserve + self.host_side

    @property
    def need(self) -> int:
        """Every part of the split: the engine, the torch side and (unified memory) both processes' host side."""
        return self.engine_peak + self.torch_side + self.host_side

    @property
    def margin(self) -> int:
        """What the split leaves of what it may use (negative: short by that much)."""
        return self.limit - self.need

    @property
    def room(self) -> int:
        """What songs' buffers may be admitted into: the limit less everything resident (>= song_room when the
        plan fits)."""
        return max(0, self.limit - self.resident)
    @property
    def gpu_memory_utilization(self) -> float | None:
        """The engine's share of the device, for vLLM (None off CUDA)."""
        return min(0.95, self.engine / self.total) if self.device == "cuda" else None

    def problems(self) -> list[str]:
        limit, need = self.limit, self.need
        if self.unified is not None:
            if need <= limit:
                return []
            return [f"unified memory: the engine ({_gib(self.engine)}: {_gib(self.engine_weights)} AR weights + "
                    f"{_gib(self.kv_cache)} KV cache for {self.max_num_seqs} rows{self._kv_form} + "
                    f"{_gib(self.engine_overhead)} overhead{self._load_words}), the torch side ({_gib(self.torch_side)}) and the host "
                    f"side of both processes "
                    f"({_gib(self.host_side)}) need {_gib(need)}, but MemAvailable is "
                    f"{_gib(self.unified.mem_available)} and, less the OS reserve of {_gib(self.unified.reserve)}, "
                    f"the pool {_gib(self.unified.pool)} "
                    f"(budget {_gib(self.budget)}); lower --concurrency or the KV cache{self._fp8_kv_hint}, use a "
                    "quantized AR checkpoint (FP8), or free host memory"]
        if need <= limit:
            return []
        if not self.ar_on_device:
            return [f"the engine ({_gib(self.engine_weights)} AR weights + {_gib(self.kv_cache)} KV cache for "
                    f"{self.max_num_seqs} rows{self._kv_form} + {_gib(self.engine_overhead)} overhead"
                    f"{self._load_words}) and the "
                    f"torch side "
                    f"({_gib(self.torch_model)} MoT without its AR expert, which waits in host memory + "
                    f"{_gib(self.vae)} VAE + {_gib(self.song_room)} room for one song's buffers + "
                    f"{_gib(self.torch_reserve)} reserve) need {_gib(need)}, but the budget allows {_gib(limit)} "
                    f"(budget {_gib(self.budget)}, {self.device} total {_gib(self.total)}); lower --concurrency "
                    f"(rows) or the KV cache{self._fp8_kv_hint}, use the FP8 AR checkpoint (--ar-checkpoint DIR: an "
                    f"FP8 W8A8 export), "
                    f"or raise --budget up to the card's {_gib(self.total)}"]
        return [f"the engine ({_gib(self.engine_weights)} AR weights + {_gib(self.kv_cache)} KV cache for "
                f"{self.max_num_seqs} rows{self._kv_form} + {_gib(self.engine_overhead)} overhead"
                f"{self._load_words}) and the "
                f"torch side "
                f"({_gib(self.torch_model)} MoT + {_gib(self.vae)} VAE + {_gib(self.nar_chunks)} NAR buffers + "
                f"{_gib(self.torch_decode)} torch AR decode + "
                f"{_gib(self.torch_reserve)} reserve) need {_gib(need)}, but the budget allows {_gib(limit)} "
                f"(budget {_gib(self.budget)}, {self.device} total {_gib(self.total)}); lower --concurrency or the "
                f"KV cache{self._fp8_kv_hint}, use --offload-ar or a quantized AR checkpoint, or raise --budget"]

    @property
    def _load_words(self) -> str:
        """Where loading the weights is the engine's peak, that figure."""
        if self.engine_peak <= self.engine:
            return ""
        return f"; {_gib(self.engine_peak)} while it loads the weights beside the mapped checkpoint file"

    @property
    def _kv_form(self) -> str:
        return f" ({KV_ELEMENT_NAMES.get(self.kv_dtype_bytes, f'{self.kv_dtype_bytes}-byte')} K/V)"

    @property
    def _fp8_kv_hint(self) -> str:
        return "" if self.kv_dtype_bytes == 1 else " (--kv-cache-dtype fp8 halves it)"

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise MemoryError(problems[0])

    def startup_problem(self, mem_available: int) -> str | None:
        """Unified memory: why vLLM's start-up check would fail now, else None. vLLM (0.28–0.33) compares
        `gpu_memory_utilization × total` with the free memory its worker measures at start, which on an
        integrated GPU is the host's available memory (psutil, i.e. MemAvailable) after the worker's own
        host side; `mem_available` is MemAvailable measured just before the worker starts."""
        if self.unified is None:
            return None
        requested = math.ceil(self.total * (self.gpu_memory_utilization or 0.0))
        worker_host = UNIFIED_HOST_BYTES["engine_process"]
        if requested + worker_host <= mem_available:
            return None
        return (f"unified memory: the engine needs {_gib(requested)} (gpu_memory_utilization "
                f"{self.gpu_memory_utilization:.4f} of {_gib(self.total)}) plus {_gib(worker_host)} for its process, "
                f"but MemAvailable is {_gib(mem_available)} now; vLLM's start-up check would refuse it. Lower "
                "--concurrency or the KV cache, use an FP8 AR checkpoint, or free host memory")

    def describe(self) -> dict:
        described = {**asdict(self), "engine_bytes": self.engine, "engine_peak_bytes": self.engine_peak,
                     "torch_bytes": self.torch_side,
                     "gpu_memory_utilization": self.gpu_memory_utilization, "unified_memory": self.unified is not None,
                     "summary": f"engine {_gib(self.engine)} (weights {_gib(self.engine_weights)}, "
                                + (f"LoRA slots {_gib(self.lora_slots)}, " if self.lora_slots else "") + "KV "
                                f"{_gib(self.kv_cache)} for {self.max_num_seqs} rows{self._kv_form}"
                                + (f"; {_gib(self.engine_peak)} loading" if self.engine_peak > self.engine else "")
                                + ") + torch "
                                f"{_gib(self.torch_side)}"
                                + (f" + host {_gib(self.host_side)}" if self.unified is not None else "")
                                + f" of {_gib(self.limit)} (margin {_gib(self.margin)})"
                                + ("" if self.ar_on_device else f"; AR expert {_gib(self.ar_host)} in host memory, "
                                   f"streamed to the NAR prefill; room for songs {_gib(self.room)}"),
                     "resident_bytes": self.resident, "room_bytes": self.room,
                     "need_bytes": self.need, "margin_bytes": self.margin}
        if self.unified is not None:
            described["unified"] = self.unified.describe()
        return described


KV_ELEMENT_NAMES = {1: "FP8", 2: "bf16", 4: "float32"}  # the engine's K/V by element bytes


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def row_kv_bytes(config: YuE2Config, tokens: int, block_tokens: int, dtype_bytes: int = 2) -> int:
    """KV one engine row reserves for a request of `tokens` (prompt + max_tokens), in whole blocks."""
    return kv_cache_bytes(config, 1, tokens, block_tokens, dtype_bytes)


def plan_memory(config: YuE2Config, *, device: str, budget_gib: float, engine_weights: int, torch_model: int,
                vae: int = 0, max_num_seqs: int | None = None, kv_cache: int | None = None,
                typical_tokens: int = PROMPT_ESTIMATE_TOKENS + 9000, max_model_len: int = CONTEXT,
                synthesis_batch: int = 1, offload_ar: bool = False, total: int | None = None,
                kv_dtype_bytes: int = 2, unified: UnifiedPool | None = None, vae_tile: int = 0,
                ar_on_device: bool | None = None, model_dtype_bytes: int = 2, lora_slots: int = 0) -> MemoryPlan:
    """Size the engine's rows and KV cache from the budget left after the torch side and the AR weights.

    Defaults: as many rows as fit a typical song (`typical_tokens` of KV each), capped per device;
    KV for that many typical songs, and never less than one `max_model_len` sequence, so that any
    single request can be admitted. Explicit `max_num_seqs` / `kv_cache` are taken as given. `lora_slots`: the
    engine's LoRA buffers (allocated with the model, before vLLM sizes the KV cache).
    `kv_dtype_bytes` is one engine K/V element (1 for an FP8 KV cache), `model_dtype_bytes` one weight of ours.
    `unified`: the device shares the host's memory (an integrated GPU): the split also counts both processes'
    host side and stays within the pool (MemAvailable less the OS reserve).
    A discrete GPU (`ar_on_device` None: CUDA without `unified`) holds the AR expert once (the engine's copy;
    ours `ar_host` bytes in host memory) and keeps `song_room` for one typical song's NAR buffers (streamed
    prefill included) or one VAE tile (`vae_tile`), whichever is larger, instead of reserving NAR chunks of a
    full context per synthesis batch and a torch-backend song's K/V; songs are admitted into what is left.
    """
    device = "cuda" if device.startswith("cuda") else "cpu"
    total = total if total is not None else total_memory_bytes(device)
    budget = int(budget_gib * GIB)
    block = KV_BLOCK_TOKENS[device]
    chunk = nar_chunk_bytes(config, CONTEXT, offload_ar) * max(1, synthesis_batch)
    unified = unified if device == "cuda" else None
    host = sum(UNIFIED_HOST_BYTES.values()) if unified is not None else 0
    decode = torch_decode_bytes(config, min(typical_tokens, max_model_len))  # a torch-backend (fallback) CFG song
    if ar_on_device is None:
        ar_on_device = not (device == "cuda" and unified is None)
    ar_host, song = 0, 0
    if not ar_on_device:  # one AR copy on the device (the engine's); songs' buffers admitted, not reserved
        ar_host = min(torch_model, ar_host_bytes(config, model_dtype_bytes))
        song = max(nar_song_bytes(config, [min(typical_tokens, max_model_len)], streamed=True), vae_tile)
        chunk, decode = 0, 0
    load = engine_weights + ENGINE_LOAD_BYTES[device] if device in ENGINE_LOAD_BYTES else 0
    base = dict(device=device, total=total, budget=budget, engine_weights=engine_weights, engine_load=load,
                engine_overhead=ENGINE_OVERHEAD_BYTES[device], torch_model=torch_model - ar_host, vae=vae,
                nar_chunks=chunk, torch_reserve=TORCH_RESERVE_BYTES, kv_block_tokens=block,
                kv_dtype_bytes=kv_dtype_bytes, host_side=host, unified=unified, torch_decode=decode,
                ar_on_device=ar_on_device, ar_host=ar_host, song_room=song, lora_slots=lora_slots)
    free = split_limit(budget, total, unified) - (engine_weights + lora_slots + ENGINE_OVERHEAD_BYTES[device]
                                                  + torch_model
                                                  - ar_host + vae + chunk + TORCH_RESERVE_BYTES + host + decode + song)
    margin = KV_MARGIN_BLOCKS * block * kv_bytes_per_token(config, kv_dtype_bytes)
    one_full = row_kv_bytes(config, max_model_len, block, kv_dtype_bytes)
    typical = row_kv_bytes(config, min(typical_tokens, max_model_len), block, kv_dtype_bytes)
    if max_num_seqs is None:
        max_num_seqs = max(1, min(ROW_CAP[device], free // typical if free > 0 else 1))
    if kv_cache is None:
        kv_cache = max(one_full, min(max(free, 0), max_num_seqs * typical)) + margin
    return MemoryPlan(kv_cache=int(kv_cache), max_num_seqs=int(max_num_seqs), **base)


def w8a8_ar_bytes(config: YuE2Config) -> int:
    """Payload bytes of a W8A8 AR checkpoint (FP8 or int8): the 7·layers linears at one byte a weight plus a bf16
    `[out, 1]` scale each, everything else bf16 (2,923,776,000 for YuE2-3B, as published)."""
    total = 0
    for name, shape in ar_tensor_shapes(config).items():
        count = math.prod(shape)
        total += count + 2 * shape[0] if name.endswith("_proj.weight") else 2 * count
    return total


# The cards of docs/memory.md's table: total memory as the driver reports it (MiB), and a DGX Spark's GB10.
CARDS_MIB = {"RTX 4080/5080 16 GB": 16376, "L4 24 GB": 23034, "RTX 4090 24 GB": 24564, "RTX 5090 32 GB": 32607,
             "L40S 48 GB": 46068, "H100 80 GB": 81559, "H200 141 GB": 143771}
KV_TABLE_FORMS = {"bf16": 2, "FP8": 1}  # the engine's KV forms the card table shows (--kv-cache-dtype auto, fp8)
GB10_MEMINFO = {"MemTotal": int(119.7 * GIB) // 1024 * 1024, "MemAvailable": 110 * GIB}  # a DGX Spark, kB-exact


def card_table(config: YuE2Config, *, mot_bytes: int, vae_bytes: int, vae_tile: int,
               ar_forms: dict[str, int], kv_forms: dict[str, int] | None = None,
               typical_tokens: int = PROMPT_ESTIMATE_TOKENS + 9000, lora_slots: int = 0) -> list[dict]:
    """Rows per card, AR form and KV form (`kv_forms`: name -> element bytes; default bf16 alone) with default
    flags (each card's default budget): what the split needs, what it may use, and the engine rows (0: refused).
    docs/memory.md's table is this function's output."""
    cards = [(name, mib * 2**20, None) for name, mib in CARDS_MIB.items()]
    info = GB10_MEMINFO
    cards.append(("GB10 (DGX Spark), MemAvailable 110 GiB", int(info["MemTotal"]),
                  UnifiedPool(info["MemTotal"], info["MemAvailable"], os_reserve_bytes(info["MemTotal"]))))
    rows = []
    for name, total, pool in cards:
        for form, weights in ar_forms.items():
            for kv, element in (kv_forms or {"bf16": 2}).items():
                plan = plan_memory(config, device="cuda", budget_gib=default_budget_gib(pool, total if pool is None
                                                                                         else None),
                                   engine_weights=weights, torch_model=mot_bytes, vae=vae_bytes, vae_tile=vae_tile,
                                   total=total, unified=pool, typical_tokens=typical_tokens, kv_dtype_bytes=element,
                                   lora_slots=lora_slots)
                rows.append({"card": name, "ar": form, "kv": kv, "rows": 0 if plan.problems() else plan.max_num_seqs,
                             "need": plan.need, "limit": plan.limit, "margin": plan.margin, "plan": plan})
    return rows


def card_table_markdown(rows: list[dict]) -> str:
    """`card_table` as docs/memory.md's markdown table."""
    lines = ["| card | AR form | KV cache | engine rows | the split needs (GiB) | it may use (GiB) | margin (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['card']} | {row['ar']} | {row.get('kv', 'bf16')} | {row['rows'] or 'refused'} | "
                     f"{row['need'] / GIB:.2f} | {row['limit'] / GIB:.2f} | {row['margin'] / GIB:+.2f} |")
    return "\n".join(lines)


ADAPTER_TABLE_COUNTS = (0, 1, 4)  # docs/memory.md's adapter rows: LoRA slots for this many rank-64 AR adapters
ADAPTER_TABLE_RANK = 64  # the released instrumental adapter's rank


def adapter_card_table(config: YuE2Config, *, mot_bytes: int, vae_bytes: int, vae_tile: int,
                       ar_forms: dict[str, int], counts=ADAPTER_TABLE_COUNTS, rank: int = ADAPTER_TABLE_RANK) -> list[dict]:
    """Rows per card and AR form (bf16 KV) with vLLM's LoRA slots for 0 / 1 / 4 rank-`rank` AR adapters (slots as
    vLLM sizes them, `lora_memory.lora_slots_bytes`): docs/memory.md's adapter table is this function's output."""
    from .lora_memory import lora_slots_bytes

    rows = []
    for count in counts:
        slots = lora_slots_bytes(config, count, rank)
        for row in card_table(config, mot_bytes=mot_bytes, vae_bytes=vae_bytes, vae_tile=vae_tile, ar_forms=ar_forms,
                              lora_slots=slots):
            rows.append({**row, "adapters": count, "lora_slots": slots})
    return rows


def adapter_card_table_markdown(rows: list[dict]) -> str:
    """`adapter_card_table` as docs/memory.md's markdown table: engine rows per card and AR form, by adapters."""
    counts = sorted({row["adapters"] for row in rows})
    slots = {row["adapters"]: row["lora_slots"] for row in rows}
    head = " | ".join(f"{count} adapter{'s' if count != 1 else ''} ({slots[count] / GIB:.2f} GiB)" for count in counts)
    lines = [f"| card | AR form | {head} |", "|---|---|" + "---|" * len(counts)]
    for key in dict.fromkeys((row["card"], row["ar"]) for row in rows):
        cells = [next(row["rows"] for row in rows if (row["card"], row["ar"]) == key and row["adapters"] == count)
                 for count in counts]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(str(cell or "refused") for cell in cells) + " |")
    return "\n".join(lines)


def release_sizes(config: YuE2Config | None = None, vae_core_frames: int = 1024) -> dict:
    """The released weights' sizes, from their shapes (no file is read): the bf16 MoT, the fp32 VAE decoder
    we keep, one VAE tile's working set, and the AR checkpoint per form (bf16, FP8 W8A8)."""
    from .model.modeling import tensor_shapes
    from .model.vae import VAEConfig, decoder_bytes

    config = config or YuE2Config()
    return {"mot_bytes": 2 * sum(math.prod(shape) for shape in tensor_shapes(config).values()),
            "vae_bytes": decoder_bytes(VAEConfig()), "vae_tile": vae_decode_bytes(VAEConfig(), vae_core_frames, 16),
            "ar_forms": {"bf16": ar_expert_bytes(config), "FP8": w8a8_ar_bytes(config)},
            "kv_forms": dict(KV_TABLE_FORMS)}
