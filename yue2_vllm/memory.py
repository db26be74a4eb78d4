"""The memory budget: how one device is split between the vLLM engine and the torch side.

The engine holds the AR checkpoint and the KV cache for its rows; the torch side holds the
whole bf16 MoT (the NAR's prefix prefill runs the AR expert), the fp32 VAE, and one NAR chunk's
buffers per song the synthesis lane runs at once. `plan_memory` sizes the engine's rows and KV
cache from what is left of the budget, and `MemoryPlan.check` refuses, naming every part, a
split that cannot fit. On CUDA the engine's share becomes its `gpu_memory_utilization` and
`kv_cache_memory_bytes`; on the CPU both sides live in host memory under the same budget.

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

from .model.modeling import YuE2Config, ar_tensor_shapes
from .protocol import CONTEXT

GIB = 2**30
TORCH_RESERVE_BYTES = 2 * GIB  # allocator slack and temporaries on the torch side
ENGINE_OVERHEAD_BYTES = {"cpu": GIB // 2, "cuda": 2 * GIB}  # activations, sampler, CUDA graphs, context
# KV block size we start the engine with: vLLM's CUDA default; on the CPU the smallest its attention kernel
# takes (vLLM-CPU defaults to 128), so prefix caching keeps all but < 32 tokens of a warmed CFG prompt.
KV_BLOCK_TOKENS = {"cpu": 32, "cuda": 16}
KV_MARGIN_BLOCKS = 2  # vLLM keeps a block back; allot two beyond what the rows need
ROW_CAP = {"cpu": 16, "cuda": 64}  # default rows: more do not pay on 2–16 CPU cores
PROMPT_ESTIMATE_TOKENS = 2048  # a song's prompt (text + ABC) for default sizing; admission uses the real one
DEFAULT_BUDGET_GIB = 24.0  # --budget when none is given, except on unified memory (the pool, see unified_pool)
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


def default_budget_gib(pool: UnifiedPool | None) -> float:
    """--budget when none is given: the unified pool on an integrated GPU, else DEFAULT_BUDGET_GIB."""
    return DEFAULT_BUDGET_GIB if pool is None else pool.pool / GIB


def budget_problem(budget_gib: float, pool: UnifiedPool | None) -> str | None:
    """Why a --budget cannot be had on unified memory (above the pool), naming both figures; None when it can."""
    if pool is None:
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
    kv_dtype_bytes: int = 2
    host_side: int = 0  # unified memory: the engine process's and our host bytes, from the same pool
    unified: UnifiedPool | None = None
    torch_decode: int = 0  # the torch AR phase's K/V rows and graph pool (memory.torch_decode_bytes)

    @property
    def limit(self) -> int:
        """What the split may use: the budget, within the device (and on unified memory, within the pool)."""
        return split_limit(self.budget, self.total, self.unified)

    @property
    def engine(self) -> int:
        return self.engine_weights + self.kv_cache + self.engine_overhead

    @property
    def torch_side(self) -> int:
        return self.torch_model + self.vae + self.nar_chunks + self.torch_reserve + self.torch_decode

    @property
    def gpu_memory_utilization(self) -> float | None:
        """The engine's share of the device, for vLLM (None off CUDA)."""
        return min(0.95, self.engine / self.total) if self.device == "cuda" else None

    def problems(self) -> list[str]:
        limit = self.limit
        need = self.engine + self.torch_side + self.host_side
        if self.unified is not None:
            if need <= limit:
                return []
            return [f"unified memory: the engine ({_gib(self.engine)}: {_gib(self.engine_weights)} AR weights + "
                    f"{_gib(self.kv_cache)} KV cache for {self.max_num_seqs} rows + {_gib(self.engine_overhead)} "
                    f"overhead), the torch side ({_gib(self.torch_side)}) and the host side of both processes "
                    f"({_gib(self.host_side)}) need {_gib(need)}, but MemAvailable is "
                    f"{_gib(self.unified.mem_available)} and, less the OS reserve of {_gib(self.unified.reserve)}, "
                    f"the pool {_gib(self.unified.pool)} "
                    f"(budget {_gib(self.budget)}); lower --concurrency or the KV cache, use --offload-ar or a "
                    "quantized AR checkpoint (FP8), or free host memory"]
        if need <= limit:
            return []
        return [f"the engine ({_gib(self.engine_weights)} AR weights + {_gib(self.kv_cache)} KV cache for "
                f"{self.max_num_seqs} rows + {_gib(self.engine_overhead)} overhead) and the torch side "
                f"({_gib(self.torch_model)} MoT + {_gib(self.vae)} VAE + {_gib(self.nar_chunks)} NAR buffers + "
                f"{_gib(self.torch_decode)} torch AR decode + "
                f"{_gib(self.torch_reserve)} reserve) need {_gib(need)}, but the budget allows {_gib(limit)} "
                f"(budget {_gib(self.budget)}, {self.device} total {_gib(self.total)}); lower --concurrency or the "
                "KV cache, use --offload-ar or a quantized AR checkpoint, or raise --budget"]

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
                "--concurrency or the KV cache, use --offload-ar or an FP8 AR checkpoint, or free host memory")

    def describe(self) -> dict:
        described = {**asdict(self), "engine_bytes": self.engine, "torch_bytes": self.torch_side,
                     "gpu_memory_utilization": self.gpu_memory_utilization, "unified_memory": self.unified is not None,
                     "summary": f"engine {_gib(self.engine)} (weights {_gib(self.engine_weights)}, KV "
                                f"{_gib(self.kv_cache)} for {self.max_num_seqs} rows) + torch {_gib(self.torch_side)}"
                                + (f" + host {_gib(self.host_side)}" if self.unified is not None else "")
                                + f" of {_gib(self.limit)}"}
        if self.unified is not None:
            described["unified"] = self.unified.describe()
        return described


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def row_kv_bytes(config: YuE2Config, tokens: int, block_tokens: int, dtype_bytes: int = 2) -> int:
    """KV one engine row reserves for a request of `tokens` (prompt + max_tokens), in whole blocks."""
    return kv_cache_bytes(config, 1, tokens, block_tokens, dtype_bytes)


def plan_memory(config: YuE2Config, *, device: str, budget_gib: float, engine_weights: int, torch_model: int,
                vae: int = 0, max_num_seqs: int | None = None, kv_cache: int | None = None,
                typical_tokens: int = PROMPT_ESTIMATE_TOKENS + 9000, max_model_len: int = CONTEXT,
                synthesis_batch: int = 1, offload_ar: bool = False, total: int | None = None,
                kv_dtype_bytes: int = 2, unified: UnifiedPool | None = None) -> MemoryPlan:
    """Size the engine's rows and KV cache from the budget left after the torch side and the AR weights.

    Defaults: as many rows as fit a typical song (`typical_tokens` of KV each), capped per device;
    KV for that many typical songs, and never less than one `max_model_len` sequence, so that any
    single request can be admitted. Explicit `max_num_seqs` / `kv_cache` are taken as given.
    `unified`: the device shares the host's memory (an integrated GPU): the split also counts both processes'
    host side and stays within the pool (MemAvailable less the OS reserve).
    """
    device = "cuda" if device.startswith("cuda") else "cpu"
    total = total if total is not None else total_memory_bytes(device)
    budget = int(budget_gib * GIB)
    block = KV_BLOCK_TOKENS[device]
    chunk = nar_chunk_bytes(config, CONTEXT, offload_ar) * max(1, synthesis_batch)
    unified = unified if device == "cuda" else None
    host = sum(UNIFIED_HOST_BYTES.values()) if unified is not None else 0
    decode = torch_decode_bytes(config, min(typical_tokens, max_model_len))  # a torch-backend (fallback) CFG song
    base = dict(device=device, total=total, budget=budget, engine_weights=engine_weights,
                engine_overhead=ENGINE_OVERHEAD_BYTES[device], torch_model=torch_model, vae=vae, nar_chunks=chunk,
                torch_reserve=TORCH_RESERVE_BYTES, kv_block_tokens=block, kv_dtype_bytes=kv_dtype_bytes,
                host_side=host, unified=unified, torch_decode=decode)
    free = split_limit(budget, total, unified) - (engine_weights + ENGINE_OVERHEAD_BYTES[device] + torch_model + vae + chunk
                    + TORCH_RESERVE_BYTES + host + decode)
    margin = KV_MARGIN_BLOCKS * block * kv_bytes_per_token(config, kv_dtype_bytes)
    one_full = row_kv_bytes(config, max_model_len, block, kv_dtype_bytes)
    typical = row_kv_bytes(config, min(typical_tokens, max_model_len), block, kv_dtype_bytes)
    if max_num_seqs is None:
        max_num_seqs = max(1, min(ROW_CAP[device], free // typical if free > 0 else 1))
    if kv_cache is None:
        kv_cache = max(one_full, min(max(free, 0), max_num_seqs * typical)) + margin
    return MemoryPlan(kv_cache=int(kv_cache), max_num_seqs=int(max_num_seqs), **base)
