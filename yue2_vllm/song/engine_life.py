"""The vLLM engine's life beside one pipeline: the split refused before any weights load (the settings it starts
with are built from the resolved options, song/resolved.py), the start (in the background, or when the first song
asks), the fallback reason and bounded retry of a failed start, stopping a start in progress, releasing it for the
NAR, and closing it.

Nothing here imports vLLM at module level; engine/backend.py is read inside the functions that drive it.
"""
from __future__ import annotations

import logging
import threading
import time

from ..checkpoint import HashCache
from ..derive import derivation_bytes
from ..model.modeling import YuE2Config
from ..room import DeviceRoom
from ..startup import STARTUP, StartRetry, StepAborted, block_counter
from .resolved import EngineInputs, engine_settings, estimated_engine_weights, vllm_usable  # noqa: F401

LOG = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 10.0  # close() waits this long at most for a background engine start to stop


def check_split(inputs: EngineInputs) -> None:
    """On a GPU, the split the engine would start with, refused (MemoryError naming the need, the limit and
    what to lower; on unified memory MemAvailable) before any weights are loaded. The AR checkpoint is
    estimated: the override's files, else the bf16 AR expert the derived checkpoint will hold."""
    config = YuE2Config.load(inputs.model_dir)
    engine_settings(inputs, None).plan(config, engine_weights=estimated_engine_weights(inputs, config)).check()


class EngineLife:
    """One pipeline's vLLM engine: built once (derivation, settings), started in the background or on demand,
    retried with backoff after a failed start, stopped, released for the NAR and closed. `room` is where songs'
    buffers are admitted beside it on a discrete GPU (None: nothing to admit into)."""

    def __init__(self, inputs: EngineInputs, hashes: HashCache):
        self.inputs, self.hashes = inputs, hashes
        self._vllm = None
        self._vllm_unavailable: str | None = None
        self._vllm_lock = threading.Lock()
        self._prestart: threading.Thread | None = None
        self._prestart_error: BaseException | None = None
        self._closing = threading.Event()  # close() in progress: start-up steps (derive, engine start) stop
        self._stops = 0  # stop_starting calls so far: a song that asked before one starts no engine after it
        self.start_retry = StartRetry()  # a failed engine start, and when it is tried again
        self.room: DeviceRoom | None = None  # songs' buffers on a discrete GPU beside the engine (room.py)

    def vllm_backend(self):
        """The vLLM backend, or None with the reason it cannot serve (decided once per pipeline, but for a failed
        start, which `select` tries again with `start_retry`'s backoff)."""
        inputs, load = self.inputs, self.inputs.options.load
        with self._vllm_lock:
            if self._vllm is None and self._vllm_unavailable is None:
                from ..engine.backend import VLLMBackend, unsupported_reason, vllm_version
                from ..quant.policy import resolve_ar_checkpoint

                reason = unsupported_reason(vllm_version())
                if reason is None:
                    derived = not load.ar_checkpoint  # resolved: the override, or $YUE2_AR_CHECKPOINT
                    with STARTUP.step("deriving", "AR checkpoint",
                                      derivation_bytes(inputs.model_dir) if derived else None) as step:
                        checkpoint = resolve_ar_checkpoint(inputs.model_dir, override=load.ar_checkpoint,
                                                           device_type=inputs.device.type, hashes=self.hashes,
                                                           verify=load.verify_hashes,
                                                           quantized_policy=inputs.options.ar.quantized_policy,
                                                           lora=inputs.lora.enabled,
                                                           on_block=block_counter(step, self._closing))
                    if checkpoint.declined:
                        LOG.info("AR checkpoint: %s", checkpoint.declined)
                    reason = checkpoint.unservable
                if reason is not None:
                    self._vllm_unavailable = reason
                else:
                    self._vllm = VLLMBackend(YuE2Config.load(inputs.model_dir), engine_settings(inputs, checkpoint))
                    if not self._vllm.plan.ar_on_device and self.room is None:
                        self.room = DeviceRoom(self._vllm.plan.room, str(inputs.device))
            return self._vllm, self._vllm_unavailable

    def start_in_background(self) -> None:
        self._prestart_error = None
        done = threading.Event()
        self._prestart = threading.Thread(target=self._start_early, args=(done,), name="yue2-engine-start",
                                          daemon=True)
        self._prestart.done = done
        self._prestart.start()

    def _start_early(self, done: threading.Event) -> None:
        try:
            vllm, _ = self.vllm_backend()
            if vllm is not None and not self._closing.is_set():
                self._start(vllm)
        except BaseException as exc:  # raised, or recorded as the fallback, when the first song asks
            self._prestart_error = exc
        finally:
            done.set()

    @staticmethod
    def _start(vllm) -> None:
        with STARTUP.step("starting_engine", "vLLM engine"):
            vllm.start()

    def join_prestart(self, timeout: float | None = None, abort: bool = False) -> BaseException | None:
        """Wait for the background engine start (at most `timeout` s); with `abort`, stop it meanwhile."""
        thread = self._prestart
        if thread is not None:
            # Waited on an Event, never Thread.join: a join that a signal interrupts (KeyboardInterrupt) marks a
            # live thread as ended in CPython 3.11 (it releases the thread's own lock), and close() would go on.
            deadline = None if timeout is None else time.monotonic() + timeout
            while not thread.done.is_set() and (deadline is None or time.monotonic() < deadline):
                if abort and self._vllm is not None:
                    self._vllm.abort_start()  # again each round: the backend may appear after a derivation
                thread.done.wait(0.1)
            if not thread.done.is_set():
                LOG.warning("the background engine start did not stop within %.0f s; leaving it", timeout)
                return self._prestart_error
            self._prestart = None
        return self._prestart_error

    def select(self, cfg_scale: float, legacy_off: bool, cfg_engine: str):
        """`(vllm, None)` whenever the engine can serve, else `(None, reason)`: the song runs on torch.

        An engine that never started is a recorded fallback; one that died is restarted (bounded) and
        a song it cannot serve any more fails with `EngineError`, never silently on another backend.
        """
        if (cfg_scale != 1.0 or legacy_off) and cfg_engine == "torch":
            what = f"cfg_scale {cfg_scale} ≠ 1" if cfg_scale != 1.0 else "cot=off legacy sampling"
            return None, f"{what}: paired CFG on vLLM is switched off (--cfg-engine torch)"
        from ..engine.backend import EngineError, EngineStartAborted

        retry, stops = self.start_retry, self._stops
        with self._vllm_lock:
            if retry.retrying and self._prestart is not None and not self._prestart.done.is_set():
                return None, f"{retry.reason}; a new start is under way"
            if retry.due():  # a failed start is tried again in the background; songs keep to torch meanwhile
                retry.retrying, self._vllm_unavailable = True, None
                LOG.warning("retrying the vLLM engine start (failed %d time(s): %s)", retry.failures, retry.reason)
                self.start_in_background()
                return None, f"{retry.reason}; a new start is under way"
        early = self.join_prestart()
        vllm, reason = self.vllm_backend()
        if vllm is not None and not vllm.running:
            try:
                if isinstance(early, (EngineError, MemoryError)) and not vllm.ever_started:
                    raise early  # the early start failed already: do not pay for a second try
                if self._stops != stops:  # the start this song waited for was stopped: no new one now
                    raise EngineStartAborted("the vLLM engine start was stopped (the pipeline is closing)")
                self._start(vllm)
            except (EngineError, MemoryError) as exc:
                if vllm.ever_started or isinstance(exc, EngineStartAborted):
                    raise  # an aborted start is the pipeline closing, not a failure to retry
                with self._vllm_lock:  # the reason without the log tail (the log is kept and named in it)
                    reason = f"vLLM engine could not start: {str(exc).split('; log tail')[0]}"
                    self._vllm, self._vllm_unavailable = None, reason
                    self.room = None  # no engine beside us: the card is the torch side's (admission by free bytes)
                    self._prestart_error = None
                    self.start_retry.failed(reason)
                vllm.close()
                vllm = None
                LOG.warning("%s; songs run on the torch backend, the start is tried again in %.0f s", reason,
                            self.start_retry.backoff_s)
        if vllm is not None and vllm.running and self.start_retry.failures:
            self.start_retry.succeeded()
        return (vllm, None) if vllm is not None else (None, reason)

    def release_for_nar(self) -> None:
        """Keep the engine across the NAR when the memory split fits (always on the CPU), else stop it."""
        keep = self.inputs.options.engine.keep
        if keep is None:
            keep = self.inputs.device.type == "cpu" or self._vllm is None or not self._vllm.plan.problems()
        if not keep:  # a start in progress (another song's) is waited for, not stopped
            self.join_prestart()
            if self._vllm is not None:
                self._vllm.close()

    def stop_starting(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop any start of the engine in progress, in any thread: a derivation stops at its next block (its temp
        removed), a starting worker is killed and its `start` raises EngineStartAborted. Waits at most `timeout`
        seconds for the background start to end (a daemon thread). A running engine is left running."""
        from ..engine.backend import EngineStartAborted

        self._stops += 1
        self._closing.set()
        try:
            if self._vllm is not None:
                self._vllm.abort_start()  # a start in a song's or the watchdog's thread
            if isinstance(self.join_prestart(timeout, abort=True), (StepAborted, EngineStartAborted)):
                self._prestart_error = None  # stopped, not failed: a later start goes ahead
        finally:
            self._closing.clear()  # a later song may start the engine again

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the engine worker, if one runs, and any start of it in progress first (`stop_starting`)."""
        self.stop_starting(timeout)
        if self._vllm is not None:
            self._vllm.close()
