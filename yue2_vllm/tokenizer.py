"""The YuE2 text tokenizer: Qwen's byte-level BPE from `qwen.tiktoken` plus 208 specials.

User text is NFC-normalised and encoded as ordinary text only: a special-token string such
as `<abc>` typed by a user becomes plain bytes, never the special id.
"""
from __future__ import annotations

import base64
import binascii
import os
import unicodedata
from pathlib import Path
from typing import Iterable

from .protocol import ABC_END, ABC_START, EOD

ORDINARY_TOKENS = 151643
TOKENIZER_FILE = "qwen.tiktoken"
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def special_tokens() -> list[str]:
    """The 208 specials in id order from EOD; slots 204/205 hold `<abc>` and `</abc>`."""
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<R>", "<S>", "<X>", "<mask>", "<sep>"]
    names += [f"<extra_{i}>" for i in range(200)]
    names[ABC_START - EOD] = "<abc>"
    names[ABC_END - EOD] = "</abc>"
    return names


class TokenizerError(ValueError):
    """`qwen.tiktoken` is missing or not the expected vocabulary."""


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse `base64(token) rank` lines and check they are exactly ranks 0..151642, all 256 bytes present."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{number}: expected 'base64-token rank'")
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (binascii.Error, ValueError):
                raise TokenizerError(f"{path}:{number}: malformed token or rank") from None
            if token in ranks:
                raise TokenizerError(f"{path}:{number}: token {token!r} listed twice")
            ranks[token] = rank
    if len(ranks) != ORDINARY_TOKENS:
        raise TokenizerError(f"{path}: has {len(ranks)} ranks, expected exactly {ORDINARY_TOKENS} (Qwen vocabulary)")
    if sorted(ranks.values()) != list(range(ORDINARY_TOKENS)):
        raise TokenizerError(f"{path}: ranks are not exactly 0..{ORDINARY_TOKENS - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte-level BPE lacks single-byte tokens {missing[:8]}")
    return ranks


class YuE2Tokenizer:
    """Encode user text to ordinary ids (< EOD) and decode ids back to text."""

    def __init__(self, path: str | os.PathLike):
        import tiktoken

        self.path = Path(path)
        specials = {name: EOD + i for i, name in enumerate(special_tokens())}
        self._encoding = tiktoken.Encoding(name=f"yue2:{self.path}", pat_str=SPLIT_PATTERN,
                                           mergeable_ranks=read_ranks(self.path), special_tokens=specials)
        self.n_vocab = self._encoding.n_vocab

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "YuE2Tokenizer":
        from .checkpoint import model_file

        return cls(model_file(model_dir, TOKENIZER_FILE))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return self._encoding.encode_ordinary(unicodedata.normalize("NFC", text))

    def decode(self, ids: Iterable[int]) -> str:
        """Decode, dropping ids outside the text vocabulary (codec and control ids)."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.n_vocab]
        return self._encoding.decode(kept, errors="replace")
