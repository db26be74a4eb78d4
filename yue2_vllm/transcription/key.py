"""The key from the pitch classes: the Krumhansl-Kessler profile (major or minor, any tonic) that correlates best
with the notes' pitch classes, each weighted by its length; named as the score's K: field can name it."""
from __future__ import annotations

# Krumhansl & Kessler (1982), probe-tone ratings from the tonic up.
MAJOR_PROFILE = (6.35, 2.23, 3.48, 2.33, 4.38, 4.09, 2.52, 5.19, 2.39, 3.66, 2.29, 2.88)
MINOR_PROFILE = (6.33, 2.68, 3.52, 5.38, 2.60, 3.53, 2.54, 4.75, 3.98, 2.69, 3.34, 3.17)
# Each tonic's name with the fewer accidentals (F# major and Eb minor where both have six).
MAJOR_KEYS = ("C", "Db", "D", "Eb", "E", "F", "F#", "G", "Ab", "A", "Bb", "B")
MINOR_KEYS = ("Cm", "C#m", "Dm", "Ebm", "Em", "Fm", "F#m", "Gm", "G#m", "Am", "Bbm", "Bm")


def estimate_key(pitches, weights) -> str:
    """The key of notes with MIDI `pitches` and `weights` (their lengths); C major when they hold one pitch class
    or none."""
    import numpy as np

    histogram = np.zeros(12)
    np.add.at(histogram, np.asarray(pitches, int) % 12, np.asarray(weights, float))
    if np.count_nonzero(histogram) < 2:
        return MAJOR_KEYS[int(np.argmax(histogram))] if histogram.any() else "C"
    best = None
    for names, profile in ((MAJOR_KEYS, MAJOR_PROFILE), (MINOR_KEYS, MINOR_PROFILE)):
        for tonic in range(12):
            score = float(np.corrcoef(histogram, np.roll(profile, tonic))[0, 1])
            if best is None or score > best[0] + 1e-12:
                best = (score, names[tonic])
    return best[1]
