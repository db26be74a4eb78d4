"""A converted adapter's record: conversion.json read once into typed fields, and written back as it always was."""
import json

from yue2_vllm.adapters.cache import RECORD, convert_adapter
from yue2_vllm.adapters.record import AdapterRecord
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.testing_adapters import write_tiny_adapter


def test_the_record_is_the_file(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "style", "lora.json", half="both", rank=4, alpha=8)
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=tmp_path / "cache")
    data = json.loads((converted.directory / RECORD).read_text())
    record = converted.record
    assert record.to_dict() == data and AdapterRecord.from_dict(data) == record
    assert list(record.to_dict()) == list(data)  # the same keys in the same order
    assert (record.layout, record.triggers, record.licence) == ("lora.json", ("tinystyle",), None)
    assert record.summary.half == "both" and (record.ar.rank, record.ar.max_lora_rank) == (4, 8) and record.nar.pairs > 0
    assert set(record.ar.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    assert convert_adapter(tiny.path, TINY_CONFIG, cache_dir=tmp_path / "cache").record == record  # reused


def test_a_nar_only_record(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "voice.safetensors", "comfyui", half="nar")
    record = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=tmp_path / "cache").record
    assert record.ar is None and record.summary.ar_rank == 0 and record.to_dict()["ar"] is None
