"""The source audio: read once (what libsndfile reads: WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF, ...), hashed as given,
mixed to mono, and refused in one line naming the problem before any analysis: not audio, too short, too long
(the transcriber's limit), not finite, silent. Nothing is written."""
from __future__ import annotations

import hashlib
import io
import math
import os
from dataclasses import dataclass

from .result import TranscriptionError

MIN_SECONDS = 1.0  # shorter than this holds no melody to transcribe
MAX_BYTES = 256 * 2 ** 20  # the largest file read: ten minutes of 48 kHz stereo float WAV, with room
SILENCE_DBFS = -60.0  # a source whose loudest sample is below this is silent
FIELD = "audio"


@dataclass(frozen=True)
class AudioInfo:
    """The source as given: the sha256 and size of its bytes, its length, rate, channels and format."""

    sha256: str
    bytes: int
    seconds: float
    sample_rate: int
    channels: int
    format: str  # libsndfile's name, e.g. "WAV", "FLAC", "OGG", "MP3"
    subtype: str  # e.g. "PCM_16", "VORBIS"
    peak_dbfs: float

    def record(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes, "seconds": round(self.seconds, 4),
                "sample_rate": self.sample_rate, "channels": self.channels, "format": self.format,
                "subtype": self.subtype, "peak_dbfs": round(self.peak_dbfs, 2)}


@dataclass(frozen=True, eq=False)
class SourceAudio:
    info: AudioInfo
    samples: object  # numpy float32 [frames], the channels' mean


def _too_large(size: int | None) -> TranscriptionError:
    known = f"{size / 2 ** 20:.1f} MiB, " if size is not None else ""
    return TranscriptionError(FIELD, f"the file is {known}larger than {MAX_BYTES / 2 ** 20:g} MiB")


def source_bytes(source) -> bytes:
    """The bytes of a path, bytes-like object or binary file (refused past MAX_BYTES before more is read)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size > MAX_BYTES:
                    raise _too_large(size)
                data = handle.read(MAX_BYTES + 1)
        except OSError as exc:
            raise TranscriptionError(FIELD, f"cannot read {os.fspath(source)!r} ({exc.strerror or exc})") from None
    elif hasattr(source, "read") and isinstance(data := source.read(MAX_BYTES + 1), (bytes, bytearray)):
        if len(data) > MAX_BYTES:
            raise _too_large(None)  # a stream read no further than the limit
        data = bytes(data)
    else:
        raise TranscriptionError(FIELD, f"expected a file path, bytes or a binary file, got {type(source).__name__}")
    if len(data) > MAX_BYTES:
        raise _too_large(len(data))
    return data


def _libsndfile_reason(exc: Exception) -> str:
    return str(getattr(exc, "error_string", "") or exc).strip().rstrip(".")


def read_audio(source, *, max_seconds: float, min_seconds: float = MIN_SECONDS) -> SourceAudio:
    """The source's samples (mono float32) and info, or a TranscriptionError(field "audio") naming the problem."""
    import numpy as np
    import soundfile

    data = source_bytes(source)
    if not data:
        raise TranscriptionError(FIELD, "the file is empty (0 bytes)")
    try:
        info = soundfile.info(io.BytesIO(data))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise TranscriptionError(FIELD, f"not audio libsndfile reads ({_libsndfile_reason(exc)}; WAV, FLAC, OGG, MP3 "
                                        "and AIFF are)") from None
    seconds = info.frames / info.samplerate if info.samplerate > 0 and info.frames > 0 else 0.0
    if seconds < min_seconds:
        raise TranscriptionError(FIELD, f"{seconds:.2f} s is too short (at least {min_seconds:g} s)")
    if seconds > max_seconds:
        raise TranscriptionError(FIELD, f"{seconds:.1f} s is too long (at most {max_seconds:g} s for this "
                                        "transcriber)")
    try:
        frames, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise TranscriptionError(FIELD, f"libsndfile cannot decode it ({_libsndfile_reason(exc)})") from None
    if frames.shape[0] / rate < min_seconds:  # a header that claims more than the file holds
        raise TranscriptionError(FIELD, f"{frames.shape[0] / rate:.2f} s is too short (at least {min_seconds:g} s)")
    if not np.isfinite(frames).all():
        raise TranscriptionError(FIELD, "holds samples that are not finite numbers (NaN or infinity)")
    peak = float(np.abs(frames).max())
    peak_dbfs = 20 * math.log10(peak) if peak > 0 else -math.inf
    if peak_dbfs < SILENCE_DBFS:
        raise TranscriptionError(FIELD, f"silent (its loudest sample is {peak_dbfs:.1f} dBFS, below "
                                        f"{SILENCE_DBFS:g} dBFS)")
    described = AudioInfo(hashlib.sha256(data).hexdigest(), len(data), frames.shape[0] / rate, int(rate),
                          frames.shape[1], info.format, info.subtype, peak_dbfs)
    return SourceAudio(described, frames.mean(axis=1, dtype=np.float32))
