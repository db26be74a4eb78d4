"""One phase's run on the engine, over its link to the worker (`routing.EventRouter`): a single row streamed until
it ends, or a CFG pair whose rows must agree on every token (resubmitted when they fall out of step, never
unguided)."""
from __future__ import annotations

import time
import uuid
from typing import Protocol, Sequence

from ..model.sampling import Cancelled, OnToken
from ..protocol import Sampling, end_token
from .worker_process import EngineError, Stream


class EngineLink(Protocol):
    """What a run needs of the engine (`routing.EventRouter`): a stream per request id, framed commands, and the
    next event."""

    def open_stream(self, rids: Sequence[str]) -> Stream: ...

    def forget_streams(self, rids: Sequence[str]) -> None: ...

    def send(self, message: dict) -> None: ...

    def abort(self, rid: str) -> None: ...

    def next_event(self, stream: Stream) -> tuple | None: ...


def request_message(rid: str, prompt: Sequence[int], max_tokens: int, stop: list[int], extra_args: dict,
                    lora: dict | None = None) -> dict:
    """A request for the worker; `lora` the adapter it runs with (`engine.lora.LoraRequest.to_dict()`), None: the base
    model (and no key, so a request without adapters is framed as it always was)."""
    message = {"id": rid, "prefix": [int(t) for t in prompt], "max_tokens": max_tokens, "stop": stop,
               "extra_args": extra_args}
    if lora is not None:
        message["lora"] = lora
    return message


class SingleRun:
    """One row: stream its tokens until it ends, is cancelled (abort) or the engine dies. With `history` (a capped
    phase's tokens) the row goes on after them: they end its prompt (prefilled, from the prefix cache where the
    engine still holds them) and count for the sampler's position, `min_tokens` and penalty window."""

    def __init__(self, backend: EngineLink, prompts, sampling: Sampling, seed: int, phase: str, legacy: bool,
                 cfg_scale: float, on_token: OnToken | None, cancelled: Cancelled | None,
                 history: Sequence[int] = (), lora: dict | None = None):
        from .plugin import row_args

        self.backend, self.phase, self.on_token, self.cancelled = backend, phase, on_token, cancelled
        self.history = list(history)
        self.rid = uuid.uuid4().hex
        self.request = request_message(self.rid, list(prompts[0]) + self.history,
                                       sampling.max_tokens - len(self.history), [end_token(phase)],
                                       row_args(phase, sampling, seed, legacy=legacy, history=self.history), lora)

    def result(self) -> tuple[list[int], dict]:
        """The phase's ids (the history first; the end token last when it came) and the engine's record."""
        backend, rid, ids = self.backend, self.rid, list(self.history)
        stream = backend.open_stream([rid])
        settled, abort_sent = False, False
        try:
            backend.send({"command": "generate", **self.request})
            while True:
                if not abort_sent and self.cancelled is not None and self.cancelled():
                    backend.abort(rid)
                    abort_sent = True
                event = backend.next_event(stream)
                if event is None:
                    continue
                _, kind, payload = event
                if kind == "tokens":
                    ids.extend(payload)
                    if self.on_token is not None:
                        for token in payload:
                            self.on_token(self.phase, token)
                    continue
                settled = True
                if kind == "done":
                    return ids, payload
                if kind == "aborted":
                    raise InterruptedError(f"cancelled during the {self.phase} phase after {len(ids)} tokens")
                if kind == "error":
                    raise EngineError(f"vLLM rejected the {self.phase} request: {payload}")
                raise EngineError(payload)  # "died"
        finally:
            backend.forget_streams([rid])
            if not settled:
                backend.abort(rid)  # e.g. on_token raised: free the engine row


class PairRun:
    """A CFG pair: cond and uncond rows share every token; only what both rows agree on is accepted.

    Each attempt submits both rows together (prompts + the tokens accepted so far). While both rows
    stay in step the processor forces the same guided token into each; a row that falls out of step
    (a partner preempted, prefilled a step later, or gone) gets the sentinel and stops. The attempt
    then keeps the rows' common prefix, aborts what still runs, and resubmits, up to `MAX_PAIR_RESTARTS`
    times (then `EngineError`: never unguided tokens). Accepted tokens are streamed as they agree.
    """

    MAX_PAIR_RESTARTS = 50

    def __init__(self, backend: EngineLink, prompts, sampling: Sampling, seed: int, phase: str, legacy: bool,
                 cfg_scale: float, on_token: OnToken | None, cancelled: Cancelled | None,
                 history: Sequence[int] = (), lora: dict | None = None):
        self.backend, self.prompts, self.sampling, self.seed = backend, prompts, sampling, seed
        self.lora = lora  # both rows run with the song's adapter
        self.phase, self.legacy, self.cfg_scale = phase, legacy, cfg_scale
        self.on_token, self.cancelled = on_token, cancelled
        self.end = end_token(phase)
        self.accepted: list[int] = list(history)  # a capped phase's tokens: accepted before the first attempt
        self.first_token: float | None = None
        self.rows_seen: list[float] = []
        self.logprobs: list[float | None] = []  # the cond row's, per accepted token
        self.cached: int | None = None  # the first attempt's cond row (its warm-up's cache hits)

    def result(self) -> tuple[list[int], dict]:
        start = time.perf_counter()
        restarts = 0
        while True:
            ended = self._attempt(start)
            if ended or len(self.accepted) >= self.sampling.max_tokens:
                rows = self.rows_seen
                info = {"ended": ended, "ttft_seconds": self.first_token, "pair_restarts": restarts,
                        "mean_batch_rows": sum(rows) / len(rows) if rows else 0.0, "logprobs": self.logprobs,
                        "cached_prompt_tokens": self.cached}
                return self.accepted + [self.end] * ended, info
            restarts += 1
            if restarts > self.MAX_PAIR_RESTARTS:
                raise EngineError(f"the CFG pair of the {self.phase} phase fell out of step {restarts} times "
                                  f"(after {len(self.accepted)} accepted tokens); not serving it unguided")

    def _attempt(self, start: float) -> bool:
        """One submission of both rows; True once the end token is accepted."""
        from .sampling import PAIR_SENTINEL
        from .plugin import Pairing, row_args

        backend, pair = self.backend, uuid.uuid4().hex
        rids = [f"{pair}-c", f"{pair}-u"]
        remaining = self.sampling.max_tokens - len(self.accepted)
        rows = [request_message(rid, prompt + self.accepted, remaining, [self.end, PAIR_SENTINEL],
                         row_args(self.phase, self.sampling, self.seed, legacy=self.legacy, history=self.accepted,
                                  pairing=Pairing(pair, role, self.cfg_scale)), self.lora)
                for rid, prompt, role in zip(rids, self.prompts, ("cond", "uncond"))]
        outputs = {rid: [] for rid in rids}
        cond_info: dict = {}
        open_rows, aborting, accepted_here, ended = set(rids), set(), 0, False
        stream = backend.open_stream(rids)
        try:
            backend.send({"command": "generate_pair", "id": pair, "rows": rows, "warm": True})
            while open_rows:
                if self.cancelled is not None and self.cancelled():
                    for rid in open_rows - aborting:
                        backend.abort(rid)
                    aborting |= open_rows
                event = backend.next_event(stream)
                if event is None:
                    continue
                rid, kind, payload = event
                if kind == "tokens":
                    outputs[rid].extend(payload)
                elif kind == "done":
                    open_rows.discard(rid)
                    self.rows_seen.append(payload["mean_batch_rows"])
                    if rid == rids[0]:
                        cond_info = payload
                elif kind == "aborted":
                    open_rows.discard(rid)
                    if rid == rids[0]:
                        cond_info = payload or {}
                elif kind == "error":
                    raise EngineError(f"vLLM rejected the {self.phase} CFG request: {payload}")
                else:
                    raise EngineError(payload)  # "died"
                agreed = common_prefix(outputs[rids[0]], outputs[rids[1]])
                agreed = agreed[:agreed.index(PAIR_SENTINEL)] if PAIR_SENTINEL in agreed else agreed
                for token in agreed[accepted_here:]:
                    if self.first_token is None:
                        self.first_token = time.perf_counter() - start
                    if token == self.end:
                        ended = True
                    else:
                        self.accepted.append(token)
                    if self.on_token is not None:
                        self.on_token(self.phase, token)
                accepted_here = len(agreed)
                # Out of step (a sentinel, or the rows disagree): stop what still runs and resubmit.
                shortest = min(len(out) for out in outputs.values())
                broken = accepted_here < shortest or any(PAIR_SENTINEL in out for out in outputs.values())
                if broken or len(open_rows) == 1:
                    for other in open_rows - aborting:
                        backend.abort(other)
                    aborting |= open_rows
            if self.cancelled is not None and self.cancelled() and not ended:
                raise InterruptedError(f"cancelled during the {self.phase} phase after {len(self.accepted)} tokens")
            logprobs = list(cond_info.get("logprobs") or [])[:accepted_here]
            self.logprobs.extend(logprobs + [None] * (accepted_here - len(logprobs)))
            if self.cached is None:
                self.cached = cond_info.get("cached_prompt_tokens")
            return ended
        finally:
            backend.forget_streams(rids)
            for rid in open_rows - aborting:
                backend.abort(rid)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return list(a[:n])
