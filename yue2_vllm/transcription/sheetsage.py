"""SheetSage2 (m-a-p/SheetSage2, CC BY-NC 4.0), for full mixes: run out of process in its own environment.

Its pins (torch 2.8, transformers 4.45.2, numpy 1.24) cannot share ours, so `calibration/setup-sheetsage-env.sh`
makes `.venv-sheetsage` (and downloads the gated weights with the user's token), and each transcription runs
`sheetsage_worker.py` there: one JSON request on its stdin, one JSON answer on its stdout. Where it runs is decided
here, once (`placement`): on the GPU in bf16 when at least GPU_FREE_GIB stays free beside the engine (the caller
says what is free), else on the CPU in fp32 (minutes a song), or not at all ("off"). Its score is melody-only
(`melody_only=True`, no chord prediction asked) and stripped of chords again as upstream's `strip-chords` does (the
sounding notes checked unchanged; `voice` keeps one melody and silences the other), then read back. Sources up to
MAX_SECONDS; SheetSage2 reads them in windows of its model's input length (WINDOW_SECONDS, 300 s: not an argument,
read back from its result) overlapping by OVERLAP_SECONDS (LOOKAHEAD_SECONDS looked ahead; both passed), and a
source longer than one window is warned about (users report phrases repeated near the joins).
The licence travels in every result.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from ..score import ScoreError, read_score, section_labels, strip_chords
from .result import Note, TranscriberUnavailable, Transcription, TranscriptionError, TranscriptionWarning
from .sections import lyric_sections, syllable_warning
from .tempo import beat_drift, drift_warning

NAME = "sheetsage2"
MODEL_REPO = "m-a-p/SheetSage2"
LICENCE = ("CC BY-NC 4.0: SheetSage2's weights (m-a-p/SheetSage2) are for non-commercial use, with attribution; "
           "a score transcribed with them carries that licence")
MAX_SECONDS = 600.0  # ten minutes: two windows and their join
# SheetSage2's defaults. The overlap and lookahead are passed explicitly; the window is its model's input length
# (hparams.input_audio_length), which transcribe takes no argument for: the result's `window_seconds` says what it was.
WINDOW_SECONDS, OVERLAP_SECONDS, LOOKAHEAD_SECONDS = 300.0, 200.0, 100.0
GPU_FREE_GIB = 8.0  # GPU memory that must stay free beside the engine for SheetSage2 to run there (bf16)
PROMPTS = ("timestamp", "downbeat_meter", "structure", "key", "melody_full")  # its tasks without chord prediction
DEVICES = ("auto", "cuda", "cpu", "off")
DEVICE_VARIABLE = "YUE2_SHEETSAGE_DEVICE"  # the device where no SheetSageSettings says one (`serve --sheetsage-device`)
TIMEOUT_SECONDS = 3600.0  # a song on the CPU takes minutes
PROTOCOL = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-sheetsage"
MODEL_DIR = REPO_ROOT / "models" / "SheetSage2-merged"  # the setup's merged copy (loads offline)
SETUP_RECORD = "yue2-sheetsage.json"  # what the setup script wrote into the venv: the model directory, versions
WORKER = Path(__file__).with_name("sheetsage_worker.py")
SETUP_HINT = ("run `bash calibration/setup-sheetsage-env.sh` (it makes .venv-sheetsage and downloads the gated "
              f"{MODEL_REPO} weights with your Hugging Face token; see docs/covers.md)")


@dataclass(frozen=True)
class SheetSageSettings:
    """Where SheetSage2 runs: `device` auto | cuda | cpu | off (default $YUE2_SHEETSAGE_DEVICE, else auto); `python`
    its environment's interpreter (default $YUE2_SHEETSAGE_PYTHON, else <repo>/.venv-sheetsage/bin/python);
    `model_dir` its weights (default $YUE2_SHEETSAGE_MODEL, else the directory the setup recorded, else
    <repo>/models/SheetSage2-merged)."""

    device: str | None = None
    python: str | None = None
    model_dir: str | None = None
    timeout_seconds: float = TIMEOUT_SECONDS

    def __post_init__(self):
        if self.device is not None and self.device not in DEVICES:
            raise ValueError(f"SheetSage2's device must be one of {', '.join(DEVICES)}, got {self.device!r}")


def sheetsage_device(settings: SheetSageSettings | None = None) -> str:
    """The device asked for: the settings', else $YUE2_SHEETSAGE_DEVICE, else "auto"; a variable that names no
    device is a TranscriberUnavailable naming it (the operator's to mend)."""
    if settings is not None and settings.device is not None:
        return settings.device
    configured = os.environ.get(DEVICE_VARIABLE, "").strip()
    if configured and configured not in DEVICES:
        raise TranscriberUnavailable(NAME, f"${DEVICE_VARIABLE}={configured!r} is not a device (one of "
                                           f"{', '.join(DEVICES)})")
    return configured or "auto"


@dataclass(frozen=True)
class SheetSageStatus:
    """Whether SheetSage2 is set up here (for `doctor`), and where; `device` the device asked for (None where
    $YUE2_SHEETSAGE_DEVICE names none: `reason` says so)."""

    ready: bool
    reason: str | None  # why not, and what to do
    python: str | None
    model_dir: str | None
    setup: dict | None  # the setup script's record (versions, revision)
    licence: str = LICENCE
    device: str | None = "auto"

    def record(self) -> dict:
        return {"ready": self.ready, "reason": self.reason, "python": self.python, "model_dir": self.model_dir,
                "setup": self.setup, "licence": self.licence, "max_seconds": MAX_SECONDS,
                "gpu_free_gib": GPU_FREE_GIB, "device": self.device}


def sheetsage_python(settings: SheetSageSettings | None = None) -> Path | None:
    """The SheetSage2 environment's python, where there is one."""
    configured = (settings.python if settings else None) or os.environ.get("YUE2_SHEETSAGE_PYTHON")
    candidate = Path(configured) if configured else VENV / "bin" / "python"
    return candidate if candidate.exists() else None


def setup_record(python: Path | None) -> dict | None:
    """The record the setup script left beside the environment's bin/ (None where there is none or it is not
    JSON)."""
    if python is None:
        return None
    try:
        record = json.loads((python.parent.parent / SETUP_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def sheetsage_model_dir(settings: SheetSageSettings | None = None, record: dict | None = None) -> Path:
    configured = (settings.model_dir if settings else None) or os.environ.get("YUE2_SHEETSAGE_MODEL")
    if configured:
        return Path(configured)
    if record and record.get("model_dir"):
        return Path(record["model_dir"])
    return MODEL_DIR


def sheetsage_status(settings: SheetSageSettings | None = None) -> SheetSageStatus:
    """Whether SheetSage2 can run here, from the files alone (no process started)."""
    python = sheetsage_python(settings)
    record = setup_record(python)
    model_dir = sheetsage_model_dir(settings, record)
    try:
        device = sheetsage_device(settings)
        reason = f"turned off here (device off: ${DEVICE_VARIABLE} or serve --sheetsage-device)" \
            if device == "off" else None
    except TranscriberUnavailable as exc:
        device, reason = None, exc.reason
    if reason is None and python is None:
        reason = f"no SheetSage2 environment (.venv-sheetsage or $YUE2_SHEETSAGE_PYTHON): {SETUP_HINT}"
    elif reason is None and not (model_dir / "config.json").is_file():
        reason = f"no SheetSage2 weights in {model_dir} (no config.json): {SETUP_HINT}"
    return SheetSageStatus(reason is None, reason, str(python) if python else None, str(model_dir), record,
                           device=device)


def placement(device: str, gpu_free_bytes: int | None) -> tuple[str, str, str]:
    """(device, dtype, why) for SheetSage2: the GPU in bf16 where `device` is "cuda", or "auto" with at least
    GPU_FREE_GIB free beside the engine (`gpu_free_bytes`, None for no GPU); else the CPU in fp32; "off" refuses."""
    if device == "off":
        raise TranscriberUnavailable(NAME, "turned off here (device off): transcribe with the built-in pyin "
                                           "transcriber, or ask the operator to turn SheetSage2 on")
    free = "no GPU" if gpu_free_bytes is None else f"{gpu_free_bytes / 2 ** 30:.1f} GiB free beside the engine"
    if device == "cpu":
        return "cpu", "fp32", "the CPU was asked for"
    if device == "cuda":
        if gpu_free_bytes is None:
            raise TranscriberUnavailable(NAME, "device cuda was asked for, but there is no GPU here")
        return "cuda", "bf16", f"the GPU was asked for ({free})"
    if gpu_free_bytes is not None and gpu_free_bytes >= GPU_FREE_GIB * 2 ** 30:
        return "cuda", "bf16", f"{free} (at least {GPU_FREE_GIB:g} GiB needed)"
    return "cpu", "fp32", f"{free} (the GPU needs at least {GPU_FREE_GIB:g} GiB free): the CPU, minutes a song"


def run_worker(python: Path, request: dict, timeout: float) -> dict:
    """One request to the worker in the SheetSage2 environment, and its answer (an "ok": false answer included);
    a worker that crashes, hangs or answers garbage is a RuntimeError with its stderr's tail."""
    try:
        done = subprocess.run([str(python), str(WORKER)], input=json.dumps({"protocol": PROTOCOL, **request}),
                              capture_output=True, text=True, encoding="utf-8", timeout=timeout,
                              env={**os.environ, "PYTHONNOUSERSITE": "1"})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{NAME} ran past its {timeout:g} s limit and was stopped") from None
    except OSError as exc:
        raise TranscriberUnavailable(NAME, f"cannot start {python} ({exc}): {SETUP_HINT}") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("protocol") != PROTOCOL:
        tail = done.stderr.strip()[-2000:]
        raise RuntimeError(f"{NAME}'s worker exited {done.returncode} without an answer; its stderr ends: {tail}")
    return answer


def _raise_refusal(answer: dict) -> None:
    message = answer.get("message", "no reason given")
    if answer.get("error") == "input":
        raise TranscriptionError("audio", message)
    if answer.get("error") == "environment":
        raise TranscriberUnavailable(NAME, f"{message} ({SETUP_HINT})")
    if answer.get("error") == "model":  # it ran and failed (out of memory, ...): nothing to say of the audio
        raise RuntimeError(f"{NAME}: {message}")
    raise RuntimeError(f"{NAME}'s worker refused the request: {message}")


def melody_only_score(abc: str, voice: str) -> str:
    """SheetSage2's score as a melody-only score: chords stripped as upstream's strip-chords does (keeping "both"
    melodies, or only "Vocal" or "Ins"), the sounding notes checked unchanged; a score that does not read is a
    RuntimeError naming the line (SheetSage2 wrote something upstream's reader refuses)."""
    try:
        return strip_chords(abc, keep_voice=voice)
    except ScoreError as exc:
        raise RuntimeError(f"{NAME} wrote a score upstream's reader refuses: {exc}") from None


def score_sections(score) -> tuple[tuple[int, str], ...]:
    """Each `% label` and the bar (1-based) it starts (score.section_labels)."""
    return tuple((index + 1, label) for index, label in section_labels(score))


def score_notes(score, bpm: int) -> tuple[Note, ...]:
    """Every sounding note of both voices in time order; `onset`/`duration` are the score's own seconds at its
    Q: (SheetSage2's timed notes stay in its worker)."""
    seconds = Fraction(60, bpm)
    notes = [Note(float(onset * seconds), float(length * seconds), pitch, onset, length, name)
             for name, voice in score.voices.items() for onset, pitch, length in voice.notes]
    return tuple(sorted(notes, key=lambda note: (note.position, note.voice)))


def model_windows(answer: dict) -> dict:
    """The windows SheetSage2 read the source in, as its result reports them (the worker's `windows`), else its
    defaults."""
    reported = answer.get("windows") if isinstance(answer.get("windows"), dict) else {}
    defaults = {"window_seconds": WINDOW_SECONDS, "overlap_seconds": OVERLAP_SECONDS,
                "lookahead_seconds": LOOKAHEAD_SECONDS}
    return {name: float(reported[name]) if isinstance(reported.get(name), (int, float)) else value
            for name, value in defaults.items()}


def _warnings(answer: dict, score, audio_seconds: float, lyrics: str, voice: str) -> list:
    found = [TranscriptionWarning("sheetsage2", f"SheetSage2: {text}", {}) for text in answer.get("warnings", ())]
    windows = model_windows(answer)
    if audio_seconds > windows["window_seconds"]:
        found.append(TranscriptionWarning(
            "window-joins", f"windows: the source is {audio_seconds:.0f} s, longer than SheetSage2's "
                            f"{windows['window_seconds']:g} s window; check the score near the joins (users report "
                            "phrases repeated there)", {"seconds": round(audio_seconds, 2), **windows}))
    vocal, ins = score.voices["Vocal"].notes, score.voices["Ins"].notes
    if voice in ("both", "Vocal") and not vocal and ins:
        found.append(TranscriptionWarning(
            "ins-only", "voices: SheetSage2 heard the melody in Ins only (an instrumental source) and Vocal rests: "
                        "YuE2 sings nothing from this score's Vocal", {"vocal_notes": 0, "ins_notes": len(ins)}))
    if lyrics.strip():
        warning = syllable_warning(lyric_sections(lyrics), len(vocal))
        found += [warning] if warning else []
    return found


def transcribe_sheetsage(audio, request, *, settings: SheetSageSettings | None = None,
                         gpu_free_bytes: int | None = None) -> Transcription:
    """`audio`: a path, bytes or binary file; `request`: a TranscriptionRequest for "sheetsage2"."""
    import soundfile

    from .audio import read_audio

    settings = settings or SheetSageSettings()
    device, dtype, why = placement(sheetsage_device(settings), gpu_free_bytes)
    status = sheetsage_status(settings)
    if not status.ready:
        raise TranscriberUnavailable(NAME, status.reason)
    start = time.perf_counter()
    source = read_audio(audio, max_seconds=MAX_SECONDS)
    timing = {"read_seconds": time.perf_counter() - start}
    with tempfile.TemporaryDirectory(prefix="yue2-sheetsage-") as work:
        path = Path(work) / "source.wav"
        soundfile.write(path, source.samples, source.info.sample_rate, subtype="FLOAT")
        clock = time.perf_counter()
        answer = run_worker(Path(status.python), {
            "op": "transcribe", "model_dir": status.model_dir, "audio": str(path), "output_dir": f"{work}/out",
            "device": device, "dtype": dtype, "prompts": list(PROMPTS), "melody_only": True,
            "max_seconds": MAX_SECONDS, "overlap_seconds": OVERLAP_SECONDS, "lookahead_seconds": LOOKAHEAD_SECONDS,
        }, settings.timeout_seconds)
        timing["worker_seconds"] = time.perf_counter() - clock
    if not answer.get("ok"):
        _raise_refusal(answer)
    clock = time.perf_counter()
    voice = request.melody_voice
    abc = melody_only_score(answer["abc"], voice)
    score = read_score(abc)
    first_bar_meter = score.voices["Vocal"].bars[0][2]
    report = beat_drift(answer.get("beats") or [], first_bar_meter, score.bpm)
    warnings = [drift_warning(report, "beat")] if report else \
        [TranscriptionWarning("drift-unmeasured", "drift: SheetSage2 returned no beat times, so the drift one Q: "
                                                  "makes of this source is not measured", {})]
    warnings += _warnings(answer, score, source.info.seconds, request.lyrics, voice)
    timing.update(answer.get("timing") or {}, score_seconds=time.perf_counter() - clock)
    details = {"device": answer.get("device"), "dtype": answer.get("dtype"), "placement": why,
               "revision": answer.get("revision"), "versions": answer.get("versions"),
               "peak_gpu_mib": answer.get("peak_gpu_mib"), "peak_rss_bytes": answer.get("peak_rss_bytes"),
               "diagnostics": answer.get("diagnostics", []), "beats": len(answer.get("beats") or []),
               "key_changes": [key for _, key in score.voices["Vocal"].keys[1:]],
               "windows": model_windows(answer)}
    version = f"{MODEL_REPO}@{answer.get('revision') or 'unrecorded'} " \
              f"(transformers {(answer.get('versions') or {}).get('transformers')})"
    return Transcription(abc, NAME, version, source.info, score.bpm, f"{first_bar_meter[0]}/{first_bar_meter[1]}",
                         score.voices["Vocal"].keys[0][1], score_notes(score, score.bpm),
                         tuple(warning for warning in warnings if warning is not None), LICENCE, timing, request,
                         tempo=report, sections=score_sections(score), details=details)
