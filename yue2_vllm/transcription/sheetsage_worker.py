"""SheetSage2 in its own environment: one JSON request on stdin, one JSON answer on stdout.

Run by `yue2_vllm.transcription.sheetsage` as a script with the SheetSage2 environment's python
(`calibration/setup-sheetsage-env.sh` makes it): that environment pins torch 2.8, transformers 4.45.2 and
numpy 1.24, which ours cannot share, so this file imports nothing of yue2_vllm, only the standard library and,
inside its functions, what that environment holds.

Request: {"protocol": 1, "op": "check" | "transcribe", "model_dir": DIR, and for "transcribe": "audio": FILE,
"output_dir": DIR, "device": "cuda" | "cpu", "dtype": "bf16" | "fp32", "prompts": [...], "melody_only": true,
"max_seconds": S, "overlap_seconds": S, "lookahead_seconds": S}.
Answer (the last line of stdout; everything the model prints goes to stderr): {"protocol": 1, "ok": true, ...} or
{"protocol": 1, "ok": false, "error": "environment" | "input" | "model" | "request", "message": ..., ...}:
- "environment": this environment or the model directory cannot run SheetSage2 (set it up again), or its
  `transcribe` does not take an argument this worker passes (`argument`);
- "input": SheetSage2 ran but built no score from this audio (its RuntimeError carrying `.result`: `abc_error`, its
  warnings);
- "model": SheetSage2 failed while it ran (out of memory, or any other error: `exception` names its type), which
  says nothing of the audio;
- "request": the request itself is not one this worker reads.
A transcription's answer holds the score (`abc`), its warnings and diagnostics, the beats, where it ran, its peak
memory and timings, and `windows`: the window, overlap and lookahead its result reports (its window is its model's
input length, which no argument sets).

SheetSage2's model card documents `transcribe(path, output_dir=, melody_only=)`; the other arguments passed
(ASSUMED_ARGUMENTS) are its pipeline's (`transcribe(model, audio, output_dir=None, *, dtype="bf16",
melody_only=False, **kwargs)` handing `prompts`, `max_seconds`, `overlap_seconds` and `lookahead_seconds` to its
analyzer), read from its remote code: a revision that does not take one is an "environment" refusal naming it.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

PROTOCOL = 1
PACKAGES = ("torch", "transformers", "numpy", "huggingface-hub")
ASSUMED_ARGUMENTS = ("dtype", "prompts", "max_seconds", "overlap_seconds", "lookahead_seconds")
_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


class Refusal(Exception):
    def __init__(self, kind: str, message: str, **extra):
        super().__init__(message)
        self.kind, self.message, self.extra = kind, message, extra


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def model_files(model_dir: str) -> dict:
    """What the model directory holds: its config, and the revision the setup recorded (if any)."""
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise Refusal("environment", f"no SheetSage2 model in {model_dir!r} (no config.json): run "
                                     "calibration/setup-sheetsage-env.sh")
    revision = None
    record = os.path.join(model_dir, "yue2-sheetsage-revision.txt")
    if os.path.isfile(record):
        with open(record, encoding="utf-8") as handle:
            revision = handle.read().strip() or None
    return {"model_dir": os.path.abspath(model_dir), "revision": revision}


def check(request: dict) -> dict:
    found = versions()
    missing = [name for name in ("torch", "transformers") if not found[name]]
    if missing:
        raise Refusal("environment", f"this environment lacks {', '.join(missing)}: run "
                                     "calibration/setup-sheetsage-env.sh", versions=found)
    import torch

    return {**model_files(request.get("model_dir")), "versions": found, "cuda": bool(torch.cuda.is_available())}


def beat_times(result: dict, output_dir: str | None) -> list[float]:
    """The decoded beats (seconds): the first number of each line of the beat annotation (`labs["beat"]`, else
    beat.lab in the output directory); [] where there is none."""
    labs = result.get("labs") or {}
    text = labs.get("beat") or labs.get("beat.lab")
    if not isinstance(text, str) and output_dir and os.path.isfile(os.path.join(output_dir, "beat.lab")):
        with open(os.path.join(output_dir, "beat.lab"), encoding="utf-8") as handle:
            text = handle.read()
    beats = []
    for line in (text or "").splitlines():
        fields = line.replace(",", " ").split()
        try:
            beats.append(float(fields[0]))
        except (IndexError, ValueError):
            continue
    return beats


def _texts(values) -> list[str]:
    return [value if isinstance(value, str) else json.dumps(value, default=str) for value in values or ()]


def run_model(model, audio: str, **arguments) -> dict:
    """SheetSage2's `transcribe(audio, **arguments)`, its failures told apart: the RuntimeError carrying `.result`
    it raises when it builds no melody-only score is the audio's ("input"); an argument it does not take is the
    environment's; anything else (torch's OutOfMemoryError, a RuntimeError of its own) is the model's."""
    try:
        return model.transcribe(audio, **arguments)
    except TypeError as exc:
        unexpected = _UNEXPECTED.search(str(exc))
        if unexpected is None or unexpected.group(1) not in arguments:
            raise Refusal("model", f"SheetSage2 failed: TypeError: {exc}", exception="TypeError") from None
        raise Refusal("environment", f"this SheetSage2's transcribe does not take the argument "
                                     f"{unexpected.group(1)!r} (its pipeline's, assumed here: "
                                     f"{', '.join(ASSUMED_ARGUMENTS)}): {exc}", argument=unexpected.group(1)) from None
    except RuntimeError as exc:
        if not hasattr(exc, "result"):  # not its "no score": torch's OutOfMemoryError is a RuntimeError too
            raise Refusal("model", f"SheetSage2 failed: {type(exc).__name__}: {exc}",
                          exception=type(exc).__name__) from None
        partial = exc.result if isinstance(exc.result, dict) else {}
        raise Refusal("input", f"SheetSage2 built no score: {exc}", abc_error=partial.get("abc_error"),
                      warnings=_texts(partial.get("warnings"))) from None
    except Exception as exc:  # its own ValueErrors and the like: said in the answer, not a traceback on stderr
        raise Refusal("model", f"SheetSage2 failed: {type(exc).__name__}: {exc}",
                      exception=type(exc).__name__) from None


def transcribe(request: dict) -> dict:
    for name in ("audio", "output_dir", "device", "dtype", "prompts"):
        if name not in request:
            raise Refusal("request", f"the request has no {name!r}")
    found = check(request)
    import torch
    from transformers import AutoModel

    device, dtype, notes = request["device"], request["dtype"], []
    if device == "cuda" and not torch.cuda.is_available():
        device, dtype = "cpu", "fp32"
        notes.append("this environment's torch sees no CUDA device: ran on the CPU in fp32")
    start = time.perf_counter()
    try:
        model = AutoModel.from_pretrained(found["model_dir"], trust_remote_code=True, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise Refusal("environment", f"SheetSage2 does not load from {found['model_dir']}: {exc}") from None
    model = model.eval().to(device)
    loaded = time.perf_counter()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    options = {name: request[name] for name in ("max_seconds", "overlap_seconds", "lookahead_seconds")
               if request.get(name) is not None}
    result = run_model(model, request["audio"], output_dir=request["output_dir"], dtype=dtype,
                       prompts=tuple(request["prompts"]), melody_only=bool(request.get("melody_only")), **options)
    done = time.perf_counter()
    if result.get("abc_error") or not result.get("abc"):
        raise Refusal("input", f"SheetSage2 built no score: {result.get('abc_error') or 'no ABC'}",
                      abc_error=result.get("abc_error"), warnings=_texts(result.get("warnings")))
    peak_gpu = result.get("peak_gpu_mib")
    if peak_gpu is None and device == "cuda":
        peak_gpu = torch.cuda.max_memory_allocated() / 2 ** 20
    import resource

    windows = {name: result[name] for name in ("window_seconds", "overlap_seconds", "lookahead_seconds")
               if isinstance(result.get(name), (int, float))}  # the window is its model's, not an argument
    return {**found, "abc": result["abc"], "warnings": _texts(result.get("warnings")) + notes, "windows": windows,
            "diagnostics": _texts(result.get("diagnostics")), "beats": beat_times(result, request["output_dir"]),
            "device": device, "dtype": dtype, "peak_gpu_mib": peak_gpu,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "timing": {"load_seconds": loaded - start, "transcribe_seconds": done - loaded}}


def main() -> int:
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # whatever the model prints (Python or C) goes to stderr; stdout carries only the answer
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False, encoding="utf-8")
    try:
        request = json.loads(sys.stdin.read() or "null")
        if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
            raise Refusal("request", f"expected a protocol {PROTOCOL} request object")
        operations = {"check": check, "transcribe": transcribe}
        if request.get("op") not in operations:
            raise Refusal("request", f"unknown op {request.get('op')!r} (check or transcribe)")
        answer = {"protocol": PROTOCOL, "ok": True, **operations[request["op"]](request)}
    except Refusal as refusal:
        answer = {"protocol": PROTOCOL, "ok": False, "error": refusal.kind, "message": refusal.message,
                  **refusal.extra}
    except json.JSONDecodeError as exc:
        answer = {"protocol": PROTOCOL, "ok": False, "error": "request", "message": f"not JSON: {exc}"}
    with os.fdopen(answer_fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(answer, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
