"""Transcriptions beside the songs: CPU work of seconds to minutes (pyin about 2 s per audio minute once warm, more
on a process's first call: librosa's imports and numba's kernels; SheetSage2 minutes on a CPU), run in a bounded pool
of processes so that it neither stalls the event loop nor holds one of its threads while it waits.

The processes are spawned (never forked from a server whose engine and synthesis run threads), started on the
first transcription and kept warm; at most `workers` run at once and `queue` more wait for one, so a call past
`workers + queue` is refused at once (429 with the figures and Retry-After). A call holds its place (`place()`) from
before its upload is read until it is answered, so a full pool refuses a call before its body arrives. A call awaits
its transcription on the event loop. A worker process that dies (killed, out of memory) fails its calls with a 503
and the pool is made again for the next.

Each worker leads its own process group, and what it starts stays in it (SheetSage2 runs in a child process): a
worker that died and a pool that is closed are ended as whole groups (SIGKILL), so no transcriber is left running,
holding its memory, after the call or the server that asked for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .errors import RequestInvalid, ServiceError, TooManyJobs, Unavailable

WORKERS = 1
QUEUE = 4
SECONDS_PER_CALL = 10  # what Retry-After guesses a call ahead takes (a minute of humming is a few seconds)


def kill_groups(pids) -> None:
    """SIGKILL the process group each pool worker in `pids` leads (the worker and what it started, where either
    still runs)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone (or the worker never made it)
            pass


def _transcribe(audio: bytes, request: dict, gpu_free_bytes: int | None, sheetsage_device: str | None):
    """Runs in a pool process: the room imported there (librosa stays out of the server's process)."""
    from ..transcription import TranscriptionRequest, transcribe

    settings = None
    if sheetsage_device is not None:
        from ..transcription.sheetsage import SheetSageSettings

        settings = SheetSageSettings(device=sheetsage_device)
    return transcribe(audio, TranscriptionRequest.from_dict(request), gpu_free_bytes=gpu_free_bytes,
                      sheetsage=settings)


class TranscriptionPool:
    """`with pool.place(): ... await pool.transcribe(audio, request)`: a place for the call (429 past the bound), then
    a Transcription, or the ServiceError to answer (422 naming the field for bad audio or a bad knob, 503 for a
    transcriber that cannot run here or a worker that died). `sheetsage_device` (auto | cuda | cpu | off; None:
    $YUE2_SHEETSAGE_DEVICE, else auto) is where SheetSage2 may run."""

    def __init__(self, workers: int = WORKERS, queue: int = QUEUE, sheetsage_device: str | None = None):
        if workers < 1 or queue < 0:
            raise ValueError(f"a transcription pool needs workers >= 1 and queue >= 0, got {workers} and {queue}")
        self.workers, self.queue, self.sheetsage_device = workers, queue, sheetsage_device
        self.calls = 0  # running or waiting (only the event loop's thread counts them)
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=os.setpgrp)  # its own group: see kill_groups
        return self._executor

    @contextlib.contextmanager
    def place(self):
        """A call's place among the `workers + queue`, held while the block runs (its upload read, its transcription
        run); past the bound a TooManyJobs (429 with the figures and Retry-After)."""
        if self.calls >= self.workers + self.queue:
            waiting = self.calls - self.workers
            raise TooManyJobs(f"{self.workers} transcription{'s are' if self.workers > 1 else ' is'} running and "
                              f"{waiting} waiting, the most this server keeps (--transcription-workers "
                              f"{self.workers}, --transcription-queue {self.queue}); retry later",
                              headers={"Retry-After": str(SECONDS_PER_CALL * (waiting + 1))})
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1

    async def transcribe(self, audio: bytes, request: dict, gpu_free_bytes: int | None = None):
        """The transcription of a call that holds its `place()`."""
        from ..transcription import TranscriberUnavailable, TranscriptionError

        executor, workers = self._pool(), []
        try:
            call = asyncio.get_running_loop().run_in_executor(executor, _transcribe, audio, request, gpu_free_bytes,
                                                              self.sheetsage_device)
            workers = list(executor._processes or {})  # started by the submit; their groups, should one die
            return await call
        except TranscriptionError as exc:
            raise RequestInvalid(str(exc), field=exc.field) from None
        except TranscriberUnavailable as exc:
            raise Unavailable(str(exc), field="transcriber") from None
        except BrokenProcessPool:
            kill_groups(workers)  # the dead worker's transcriber (SheetSage2's process) goes with it
            if self._executor is executor:  # the next call starts a new one
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            raise Unavailable("the transcription worker died (killed, or out of memory); retry",
                              headers={"Retry-After": str(SECONDS_PER_CALL)}) from None
        except Exception as exc:  # a transcriber's own failure: said, not hidden behind a bare 500
            raise ServiceError(f"the transcription failed: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Stop the workers: waiting calls are cancelled, a running transcription is ended with its process group
        (the worker and the transcriber it started)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((executor._processes or {}).values())  # the executor has no public way to end them
        executor.shutdown(wait=False, cancel_futures=True)
        kill_groups(process.pid for process in processes)
        for process in processes:
            if process.is_alive():  # not its own group yet (its initializer had not run): the worker alone
                process.kill()
        for process in processes:
            process.join(timeout=10)
