"""Synthesized melodies with known notes, for the transcription tests: a voice-like tone (a fundamental and its
decaying harmonics) with vibrato, breath noise and articulation, at a known tempo (or one that moves)."""
from __future__ import annotations

import io

import numpy as np

RATE = 16000


def synthesize(notes, bpm: float, *, rate: int = RATE, vibrato_semitones: float = 0.0, vibrato_hz: float = 5.5,
               noise_dbfs: float | None = None, articulation: float = 0.9, legato_dip_db: float | None = None,
               tempo_end: float | None = None, lead_seconds: float = 0.3, tail_seconds: float = 0.4,
               detune_semitones: float = 0.0, seed: int = 0) -> np.ndarray:
    """Mono float32 audio of `notes` — (position, length, MIDI pitch) in quarter notes — at `bpm` (moving
    linearly to `tempo_end` by the last note when given). Each note sounds `articulation` of its length (attack
    15 ms, release 30 ms); with `legato_dip_db`, a note that another follows without a rest keeps sounding and only
    dips by that much for its last 50 ms (a repeated note sung again)."""
    rng = np.random.default_rng(seed)
    end_quarter = max(p + n for p, n, _ in notes)

    def seconds(quarter: float) -> float:  # time of a quarter position, the tempo moving linearly in quarters
        if tempo_end is None:
            return lead_seconds + quarter * 60.0 / bpm
        grid = np.linspace(0.0, quarter, 400)
        rates = bpm + (tempo_end - bpm) * grid / end_quarter
        return lead_seconds + float(np.trapezoid(60.0 / rates, grid)) if quarter > 0 else lead_seconds

    total = seconds(end_quarter) + tail_seconds
    count = int(total * rate)
    t = np.arange(count) / rate
    frequency = np.zeros(count)
    envelope = np.zeros(count)
    for index, (position, length, pitch) in enumerate(notes):
        start, stop = seconds(position), seconds(position + length)
        legato = legato_dip_db is not None and index + 1 < len(notes) and \
            abs(notes[index + 1][0] - (position + length)) < 1e-9
        sounding_end = stop if legato else start + articulation * (stop - start)
        a, b = int(start * rate), int(sounding_end * rate)
        frequency[a:b] = 440.0 * 2 ** ((pitch + detune_semitones - 69) / 12)
        attack = np.minimum(1.0, (t[a:b] - start) / 0.015)
        if legato:
            shape = np.where(t[a:b] > stop - 0.05, 10 ** (-legato_dip_db / 20), attack)
        else:
            shape = attack * np.minimum(1.0, (sounding_end - t[a:b]) / 0.03)
        envelope[a:b] = np.maximum(envelope[a:b], shape)
    wobble = vibrato_semitones * np.sin(2 * np.pi * vibrato_hz * t)
    phase = 2 * np.pi * np.cumsum(frequency * 2 ** (wobble / 12)) / rate
    tone = sum(amplitude * np.sin(k * phase) for k, amplitude in ((1, 1.0), (2, 0.5), (3, 0.25), (4, 0.12)))
    audio = 0.3 * envelope * tone / 1.87
    if noise_dbfs is not None:
        audio = audio + rng.normal(0.0, 10 ** (noise_dbfs / 20), count)
    return audio.astype(np.float32)


def wav_bytes(audio: np.ndarray, rate: int = RATE, format: str = "WAV", subtype: str | None = None) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate, format=format, subtype=subtype)
    return buffer.getvalue()
