"""The transcription room: audio in, a melody-mode score out, for covers and hums.

One interface, `transcribe(audio, request)`, and two transcribers, neither imported unless used: "pyin" (built in,
for a single melodic line: librosa's pYIN, no weights) and "sheetsage2" (full mixes: SheetSage2 in its own
environment, out of process). Both return a `Transcription` whose score the project's upstream-exact reader has
read back; bad input is a `TranscriptionError` (a ValueError naming the field) and nothing is written.
"""
from __future__ import annotations

import time
from dataclasses import replace

from .request import TRANSCRIBERS, TranscriptionRequest
from .result import Note, TempoReport, TranscriberUnavailable, Transcription, TranscriptionError, TranscriptionWarning

__all__ = ["TRANSCRIBERS", "Note", "TempoReport", "TranscriberUnavailable", "Transcription", "TranscriptionError",
           "TranscriptionRequest", "TranscriptionWarning", "max_seconds", "transcribe", "transcribers_status"]


def max_seconds(transcriber: str) -> float:
    """The longest source a transcriber takes (seconds)."""
    if transcriber == "pyin":
        from .pyin import MAX_SECONDS
    elif transcriber == "sheetsage2":
        from .sheetsage import MAX_SECONDS
    else:
        raise TranscriptionError("transcriber", f"{transcriber!r} is not a transcriber (one of "
                                                f"{', '.join(TRANSCRIBERS)})")
    return MAX_SECONDS


def transcribers_status(sheetsage=None) -> dict:
    """Whether each transcriber can run here, from what is installed and set up (nothing imported or started): for
    `doctor`. `sheetsage`: a SheetSageSettings (default: the environment's)."""
    from importlib.metadata import PackageNotFoundError, version

    from .sheetsage import sheetsage_status

    try:
        librosa = version("librosa")
    except PackageNotFoundError:
        librosa = None
    pyin = {"ready": librosa is not None, "librosa": librosa, "max_seconds": max_seconds("pyin"),
            "reason": None if librosa else "librosa is not installed: pip install 'yue2-vllm[transcribe]'"}
    return {"pyin": pyin, "sheetsage2": sheetsage_status(sheetsage).record()}


def transcribe(audio, request: TranscriptionRequest | None = None, *, gpu_free_bytes: int | None = None,
               sheetsage=None, **fields) -> Transcription:
    """The melody-mode score of `audio` (a path, bytes or a binary file in a format libsndfile reads).

    `request` (or its fields as keywords: transcriber, bpm, meter, key, lyrics, voice, pickup_beats) says what to
    transcribe. For "sheetsage2", `sheetsage` (a SheetSageSettings) says where it runs and `gpu_free_bytes` what GPU
    memory is free beside the engine (None: no GPU). Raises TranscriptionError for bad input (nothing written) and
    TranscriberUnavailable when the transcriber cannot run here."""
    if request is None:
        request = TranscriptionRequest(**fields)
    elif fields:
        raise TypeError(f"give a request or its fields, not both ({', '.join(sorted(fields))})")
    start = time.perf_counter()
    if request.transcriber == "pyin":
        from .pyin import transcribe_pyin

        result = transcribe_pyin(audio, request)
    else:
        from .sheetsage import transcribe_sheetsage

        result = transcribe_sheetsage(audio, request, settings=sheetsage, gpu_free_bytes=gpu_free_bytes)
    return replace(result, timing={**result.timing, "total_seconds": time.perf_counter() - start})
