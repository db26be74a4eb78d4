"""The server's transcription pool (serve/transcribing.py), as `serve` makes it: where SheetSage2 may run is the
operator's (`--sheetsage-device`, else $YUE2_SHEETSAGE_DEVICE), carried into the pool's spawned processes."""
import asyncio

import pytest

from yue2_vllm.cli import build_parser
from yue2_vllm.serve.errors import Unavailable
from yue2_vllm.serve.transcribing import TranscriptionPool


def test_sheetsage2_turned_off_on_the_server_is_a_503_naming_it(monkeypatch):
    monkeypatch.delenv("YUE2_SHEETSAGE_DEVICE", raising=False)
    assert build_parser().parse_args(["serve", "--sheetsage-device", "off"]).sheetsage_device == "off"
    assert build_parser().parse_args(["serve"]).sheetsage_device is None  # $YUE2_SHEETSAGE_DEVICE, else auto
    pool = TranscriptionPool(1, 0, sheetsage_device="off")
    try:
        with pytest.raises(Unavailable) as caught:
            asyncio.run(pool.transcribe(b"not even audio", {"transcriber": "sheetsage2"}))
    finally:
        pool.close()
    assert (caught.value.status, caught.value.field) == (503, "transcriber")
    assert caught.value.message.startswith("sheetsage2: turned off here (device off)")
