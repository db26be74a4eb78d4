"""A song's picture for the page, computed once from its FLAC: per-channel peaks and a log-frequency spectrogram,
small enough to send in one answer (~115 KB of JSON for a song of any length) instead of the whole file.

The FLAC is read in blocks, so a 6-minute song never sits in memory as a float buffer (138 MB). `peaks`: per
channel, `PEAK_BUCKETS` (min, max) pairs over equal spans of the song, as int8 (×127). `spectrogram`: the
channels' mean, `COLUMNS` Hann-windowed FFTs of `FFT_SIZE` samples centred on equal spans, `ROWS` log-spaced
bands from `LOW_HZ` to Nyquist (each the loudest bin between its edges), in dB over the loudest 80 dB as uint8
(0: 80 dB down or quieter, 255: the loudest), column after column, lowest band first.
"""
from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy as np

PICTURE_VERSION = 1
PEAK_BUCKETS = 4096
COLUMNS, ROWS, FFT_SIZE, LOW_HZ = 720, 96, 2048, 40.0
DYNAMIC_DB = 80.0
BLOCK_FRAMES = 1 << 18


def _bucket_extremes(block: np.ndarray, first: int, frames: int, low: np.ndarray, high: np.ndarray) -> None:
    """Fold a block of samples (starting at sample `first`) into the buckets' running min / max."""
    buckets = (np.arange(first, first + len(block), dtype=np.int64) * PEAK_BUCKETS) // frames
    starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
    ids = buckets[starts]
    np.minimum.at(low, ids, np.minimum.reduceat(block, starts, axis=0))
    np.maximum.at(high, ids, np.maximum.reduceat(block, starts, axis=0))


def _spectrogram(windows: np.ndarray, sample_rate: int) -> np.ndarray:
    """`[COLUMNS, FFT_SIZE]` mono windows → `[COLUMNS, ROWS]` uint8 levels."""
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(FFT_SIZE) / (FFT_SIZE - 1))
    power = np.abs(np.fft.rfft(windows * hann, axis=1)) ** 2
    bin_hz = sample_rate / FFT_SIZE
    edges = LOW_HZ * (sample_rate / 2 / LOW_HZ) ** (np.arange(ROWS + 1) / ROWS) / bin_hz
    bands = np.empty((len(windows), ROWS))
    for row in range(ROWS):
        first = int(math.floor(edges[row]))
        last = min(max(first, int(math.floor(edges[row + 1]))), FFT_SIZE // 2 - 1)
        bands[:, row] = power[:, first:last + 1].max(axis=1)
    levels = 10 * np.log10(bands + 1e-12)
    scaled = np.clip((levels - levels.max() + DYNAMIC_DB) / DYNAMIC_DB, 0, 1)
    return np.round(scaled * 255).astype(np.uint8)


def song_picture(path: Path) -> dict:
    """The picture of the FLAC at `path` (see the module docstring); `duration` in seconds."""
    import soundfile

    with soundfile.SoundFile(str(path)) as audio:
        frames, rate, channels = audio.frames, audio.samplerate, audio.channels
        if frames < 1:
            raise ValueError(f"{path.name} holds no audio")
        lanes = min(2, channels)
        low = np.zeros((PEAK_BUCKETS, lanes), np.float32)
        high = np.zeros((PEAK_BUCKETS, lanes), np.float32)
        starts = (np.arange(COLUMNS, dtype=np.int64) * 2 + 1) * frames // (2 * COLUMNS) - FFT_SIZE // 2
        windows = np.zeros((COLUMNS, FFT_SIZE), np.float32)
        position = 0
        for block in audio.blocks(blocksize=BLOCK_FRAMES, dtype="float32", always_2d=True):
            block = block[:, :lanes]
            _bucket_extremes(block, position, frames, low, high)
            mono = block.mean(axis=1) if lanes > 1 else block[:, 0]
            end = position + len(block)
            for column in np.flatnonzero((starts < end) & (starts + FFT_SIZE > position)):
                a, b = max(starts[column], position), min(starts[column] + FFT_SIZE, end)
                windows[column, a - starts[column]:b - starts[column]] = mono[a - position:b - position]
            position = end
    if lanes == 1:  # a mono file: the same in both lanes
        low, high = np.repeat(low, 2, axis=1), np.repeat(high, 2, axis=1)
    peaks = [np.round(np.stack([low[:, c], high[:, c]], axis=1).reshape(-1) * 127).astype(np.int8) for c in range(2)]
    return {"version": PICTURE_VERSION, "duration": frames / rate, "sample_rate": rate, "buckets": PEAK_BUCKETS,
            "peaks": [base64.b64encode(lane.tobytes()).decode("ascii") for lane in peaks],
            "columns": COLUMNS, "rows": ROWS, "low_hz": LOW_HZ, "dynamic_db": DYNAMIC_DB,
            "spectrogram": base64.b64encode(_spectrogram(windows, rate).tobytes()).decode("ascii")}
