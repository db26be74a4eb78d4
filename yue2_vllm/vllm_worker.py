"""The vLLM engine process: `python -m yue2_vllm.vllm_worker`, driven over stdin/stdout JSON lines.

One in-process vLLM `LLMEngine` lives for the worker's lifetime (across phases and songs). The
parent sends one setup line, then commands: `{"command": "generate", ...}`, `{"command":
"abort", "id"}`, `{"command": "shutdown"}`. Events go back on the original stdout as
`YUE2\\t{json}` lines (`ready`, `token`, `result`, `aborted`, `error`); everything vLLM prints
is moved to stderr (the parent's log file). EOF on stdin (the parent died) ends the worker.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

EVENT_PREFIX = "YUE2\t"


class Channel:
    """Protocol output on a private copy of stdout; fd 1 itself now points at stderr."""

    def __init__(self):
        self._out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def emit(self, event: dict) -> None:
        self._out.write(EVENT_PREFIX + json.dumps(event) + "\n")
        self._out.flush()


def read_commands(commands: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            commands.put(json.loads(line))
    commands.put({"command": "shutdown"})  # parent closed our stdin


def build_engine(setup: dict):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=setup["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=setup["max_model_len"],
        max_num_seqs=setup["max_num_seqs"], max_num_batched_tokens=setup["max_num_batched_tokens"],
        enable_chunked_prefill=True, enable_prefix_caching=True, enforce_eager=setup["enforce_eager"],
        kv_cache_memory_bytes=setup["kv_cache_bytes"], seed=setup.get("engine_seed", 0),
        logits_processors=setup.get("logits_processors") or None, disable_log_stats=True,
        gpu_memory_utilization=setup.get("gpu_memory_utilization", 0.9),
    )
    return LLMEngine.from_engine_args(args)


def sampling_params(request: dict):
    from vllm import SamplingParams

    s = request["sampling"]
    return SamplingParams(
        temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], min_tokens=s["min_tokens"],
        max_tokens=s["max_tokens"], repetition_penalty=1.0, seed=request["seed"],
        stop_token_ids=[request["end"]], allowed_token_ids=request["allowed"], detokenize=False,
        extra_args={"yue2_window_penalty": s["repetition_penalty"], "yue2_penalty_window": s["penalty_window"]},
    )


def run_request(engine, request: dict, commands: queue.Queue, channel: Channel) -> bool:
    """Generate one request, streaming tokens; returns False when a shutdown arrived meanwhile."""
    rid, end = request["id"], request["end"]
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": request["prefix"]}, sampling_params(request))
    sent, first, keep_running = 0, None, True
    while engine.has_unfinished_requests():
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command is not None:
            if command.get("command") in ("abort", "shutdown"):
                engine.abort_request([rid])
                channel.emit({"event": "aborted", "id": rid})
                return command.get("command") != "shutdown"
        for output in engine.step():
            if output.request_id != rid:
                continue
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            for token in ids[sent:]:
                if first is None:
                    first = time.perf_counter() - start
                channel.emit({"event": "token", "id": rid, "token": int(token)})
            sent = len(ids)
            if output.finished:
                ended = bool(ids and ids[-1] == end) or completion.stop_reason == end
                if ended and (not ids or ids[-1] != end):
                    channel.emit({"event": "token", "id": rid, "token": end})
                content = ids[:-1] if ids and ids[-1] == end else ids
                seconds = time.perf_counter() - start
                count = len(content) + int(ended)
                channel.emit({"event": "result", "id": rid, "ids": content, "truncated": not ended, "timing": {
                    "seconds": seconds, "ttft_seconds": first, "output_tokens": count,
                    "content_tokens": len(content), "output_tps": count / seconds if seconds > 0 else 0.0,
                    "prefix_tokens": len(request["prefix"])}})
    return keep_running


def main() -> int:
    channel = Channel()
    commands: queue.Queue = queue.Queue()
    setup = json.loads(sys.stdin.readline())
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
    try:
        import vllm

        start = time.perf_counter()
        engine = build_engine(setup)
        channel.emit({"event": "ready", "vllm_version": vllm.__version__,
                      "engine_load_seconds": time.perf_counter() - start})
    except Exception as exc:  # reported to the parent, which raises with the log tail
        channel.emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    while True:
        command = commands.get()
        kind = command.get("command")
        if kind == "shutdown":
            return 0
        if kind != "generate":
            continue  # an abort for a request that already finished
        try:
            if not run_request(engine, command, commands, channel):
                return 0
        except Exception as exc:
            channel.emit({"event": "error", "id": command.get("id"), "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    sys.exit(main())
