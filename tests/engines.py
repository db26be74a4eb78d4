"""The session's vLLM engines, shared by their settings (conftest's `engines` fixture).

An engine start is the slowest step of most engine tests (10-15 s here). Tests whose engines would start with the
same settings get one engine: `engines.pipeline(...)` is a `YuE2Pipeline` on the pool's engine for its settings,
`engines.backend(config, settings)` such an engine itself, and `with engines.shared():` lends the pool's engines to
every pipeline made meanwhile (a CLI `main` run in the test's process). A borrower's `close()` leaves a shared
engine running; the pool stops the least recently lent one beyond RESIDENT, and all of them at the session's end.

A test that kills or restarts its engine, counts its restarts or its first start's record, or needs settings no
other test has, makes an engine of its own (VLLMBackend, YuE2Pipeline) and says why in a comment.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import fields, replace

from yue2_vllm.engine.backend import EngineSettings, VLLMBackend
from yue2_vllm.options import EngineOptions

# The engines most pipeline tests share, whatever their generation config (rows and KV bytes fixed, not sized by
# it): a float32 engine (AROptions(backend="vllm", dtype="float32")), and the same rows for --reproducible
# (AROptions(backend="vllm", reproducible=True): float32 and batch-invariant on vLLM-CPU). 64-token steps: a
# prompt of the tiny tests is prefilled in chunks. The bf16 default (no engine options) is shared as sized.
FLOAT32_ENGINE = EngineOptions(max_num_seqs=8, max_num_batched_tokens=64, tuning={"kv_cache_bytes": 32 << 20})
REPRODUCIBLE_ENGINE = EngineOptions(max_num_seqs=16, max_num_batched_tokens=64, tuning={"kv_cache_bytes": 48 << 20})

# What only sizes the engine: settings that size it alike (the same rows, KV bytes and threads, below) are one engine.
SIZING = ("memory_budget_gib", "typical_tokens", "torch_side_bytes", "vae_tile_bytes", "synthesis_batch",
          "torch_ar_on_device")
DEFAULTS = {f.name: f.default for f in fields(EngineSettings)}
RESIDENT = 3  # engines running at once (a tiny one's worker holds ~1.2 GB here)


class SharedEngine(VLLMBackend):
    """A pooled engine: `close()` (a pipeline's, a test's) leaves it running; the pool's `shut()` stops it."""

    def close(self) -> None:
        pass

    def shut(self) -> None:
        super().close()


class EnginePool:
    def __init__(self):
        self._engines: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(config, settings: EngineSettings) -> str:
        """The engine these settings start: sized (rows, KV bytes, threads), the sizing inputs then left out (as
        text: a settings' parts need not hash)."""
        sized = settings.resolved(config)
        return repr((config, replace(sized, **{name: DEFAULTS[name] for name in SIZING})))

    def backend(self, config, settings: EngineSettings) -> VLLMBackend:
        """The pool's engine for these settings (made, not started, the first time; made again if it is gone). At
        most RESIDENT of them run: the least recently lent beyond them is stopped (its next song starts it again)."""
        key = self.key(config, settings)
        with self._lock:
            engine = self._engines.pop(key, None)
            if engine is None or engine.gone_for_good:
                engine = SharedEngine(config, settings)
            self._engines[key] = engine  # the dict's order: least recently lent first
            for idle in list(self._engines.values())[:-RESIDENT]:
                idle.shut()
            return engine

    @contextlib.contextmanager
    def shared(self):
        """Pipelines made meanwhile take the pool's engines (their `EngineLife` makes its backend through this)."""
        import yue2_vllm.engine.backend as module

        made = module.VLLMBackend
        module.VLLMBackend = self.backend
        try:
            yield self
        finally:
            module.VLLMBackend = made

    def pipeline(self, *args, **kwargs):
        """`YuE2Pipeline(*args, **kwargs)` on the pool's engine for its settings (its AR checkpoint resolved now)."""
        from yue2_vllm.pipeline import YuE2Pipeline

        with self.shared():
            pipe = YuE2Pipeline(*args, **kwargs)
            pipe.engine_life.vllm_backend()
        assert isinstance(pipe.engine, SharedEngine), "the pipeline's engine is not the pool's"
        return pipe

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.shut()
