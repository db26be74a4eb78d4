"""The source audio: read once (what libsndfile reads: WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF, ...), hashed as given,
mixed to mono, and refused in one line naming the problem before any analysis: not audio, too short, too long
(the transcriber's limit), a sample rate, channel count or decoded size past what is read (a small compressed file
can claim gigabytes of samples: its header is checked before anything is decoded), not finite, silent. Nothing is
written."""
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
MAX_SAMPLE_RATE = 192_000  # the highest sample rate read (a studio master's); FLAC's header allows up to 655,350 Hz
MAX_CHANNELS = 8  # the most channels read (7.1)
# The most samples (all channels) decoded a second of the transcriber's limit: 96 kHz stereo. A source's frames
# times channels may not exceed max_seconds times this (264 MiB of float32 for pyin's 360 s, 439 MiB for
# SheetSage2's 600 s), whatever its rate and channels.
DECODED_SAMPLES_PER_SECOND = 96_000 * 2
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


def _check_decoded_size(rate: int, channels: int, frames: int, max_seconds: float) -> None:
    """Refuse, from the header alone, a source whose samples would decode past what is read: a rate above
    MAX_SAMPLE_RATE, more than MAX_CHANNELS channels, or more samples than max_seconds of 96 kHz stereo."""
    if rate > MAX_SAMPLE_RATE:
        raise TranscriptionError(FIELD, f"its sample rate is {rate} Hz, above {MAX_SAMPLE_RATE} Hz (the highest read)")
    if channels > MAX_CHANNELS:
        raise TranscriptionError(FIELD, f"it has {channels} channels, more than {MAX_CHANNELS} (the most read)")
    limit = int(max_seconds * DECODED_SAMPLES_PER_SECOND)
    if frames * channels > limit:
        raise TranscriptionError(FIELD, f"{frames} frames of {channels} channels at {rate} Hz decode to "
                                        f"{frames * channels * 4 / 2 ** 20:.0f} MiB, more than the "
                                        f"{limit * 4 / 2 ** 20:.0f} MiB read ({max_seconds:g} s of 96 kHz stereo)")


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
    _check_decoded_size(info.samplerate, info.channels, info.frames, max_seconds)
    try:
        frames, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise TranscriptionError(FIELD, f"libsndfile cannot decode it ({_libsndfile_reason(exc)})") from None
    if frames.shape[0] / rate < min_seconds:  # a header that claims more than the file holds
        raise TranscriptionError(FIELD, f"{frames.shape[0] / rate:.2f} s is too short (at least {min_seconds:g} s)")
    high, low = float(frames.max()), float(frames.min())  # no copy of the samples (NaN propagates through both)
    if not (math.isfinite(high) and math.isfinite(low)):
        raise TranscriptionError(FIELD, "holds samples that are not finite numbers (NaN or infinity)")
    peak = max(high, -low)
    peak_dbfs = 20 * math.log10(peak) if peak > 0 else -math.inf
    if peak_dbfs < SILENCE_DBFS:
        raise TranscriptionError(FIELD, f"silent (its loudest sample is {peak_dbfs:.1f} dBFS, below "
                                        f"{SILENCE_DBFS:g} dBFS)")
    described = AudioInfo(hashlib.sha256(data).hexdigest(), len(data), frames.shape[0] / rate, int(rate),
                          frames.shape[1], info.format, info.subtype, peak_dbfs)
    return SourceAudio(described, frames.mean(axis=1, dtype=np.float32))
