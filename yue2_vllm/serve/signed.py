"""Short-lived signed audio URLs: what an `<audio>` element, which cannot send `Authorization`, plays with.

A URL names one song's audio and the second it expires, signed with a key derived from the server's API key
(HMAC-SHA256), so it survives a restart and works on every server holding the same key, and grants nothing else.
"""
from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlencode

AUDIO_URL_SECONDS = 900  # how long a signed audio URL plays (the page asks for a new one when it expires)
SIGNATURE_PATTERN = r"^[0-9a-f]{64}$"


def signing_key(api_key: str) -> bytes:
    """The audio URLs' key: never the API key itself, so a URL in a log cannot be turned back into it."""
    return hmac.new(api_key.encode(), b"yue2-vllm signed audio URL v1", hashlib.sha256).digest()


def audio_signature(key: bytes, job_id: str, expires: int) -> str:
    return hmac.new(key, f"{job_id}\n{expires}".encode(), hashlib.sha256).hexdigest()


def signed_audio_query(key: bytes, job_id: str, now: float, lifetime: int = AUDIO_URL_SECONDS) -> tuple[str, int]:
    """`expires=…&signature=…` for the song's audio route, and when it expires (Unix seconds)."""
    expires = int(now) + lifetime
    return urlencode({"expires": expires, "signature": audio_signature(key, job_id, expires)}), expires


def signature_problem(key: bytes, job_id: str, expires: int | None, signature: str | None, now: float,
                      lifetime: int = AUDIO_URL_SECONDS) -> str | None:
    """None when the signature opens this song's audio now; else what is wrong, in words."""
    if expires is None or signature is None:
        return "missing API key or signed URL: send 'Authorization: Bearer KEY' or use GET …/audio-url's url"
    if expires < now:
        return "this signed audio URL has expired: ask GET …/audio-url for a new one"
    if expires > now + lifetime + 60:  # never a URL that outlives what this server signs
        return f"this signed audio URL expires later than this server signs ({lifetime} s)"
    if not hmac.compare_digest(signature, audio_signature(key, job_id, expires)):
        return "this signed audio URL's signature is wrong (another song, another key, or changed)"
    return None
