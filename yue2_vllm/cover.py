"""A cover: a song whose score was transcribed from audio (docs/covers.md). Every face that makes one — `generate
--melody-audio`, batch rows and request files with `melody_audio`, `POST /v1/covers` — builds its request here,
from the `Transcription` and the song's own fields: the score byte for byte as its `abc`, cot "melody" (upstream's
cover recipe: a melody-only score rendered with the target style and lyrics), and the transcription's record
(`Transcription.summary()`, checked by `protocol.check_transcription`), which the song carries outside its
identity."""
from __future__ import annotations

from .protocol import SongRequest

COVER_COT = "melody"


def cover_request(transcription, /, *, style: str, lyrics: str, **fields) -> SongRequest:
    """The SongRequest of a cover of `transcription` (a transcription.Transcription: its `abc` and `summary()`) with
    the song's `style`, `lyrics` and other SongRequest fields (seed, id, seconds, cfg_scale, adapters, ...). A
    field the cover decides (abc, transcription) or a cot other than melody is a ValueError naming it."""
    for name in ("abc", "transcription"):
        if name in fields:
            raise ValueError(f"SongRequest.{name}: a cover's {name} is its transcription's; leave it out")
    cot = fields.pop("cot", None)
    if cot not in (None, COVER_COT):
        raise ValueError(f"SongRequest.cot: a cover renders its transcribed melody with cot {COVER_COT!r}, got "
                         f"{cot!r}")
    return SongRequest(style=style, lyrics=lyrics, cot=COVER_COT, abc=transcription.abc,
                       transcription=transcription.summary(), **fields)
