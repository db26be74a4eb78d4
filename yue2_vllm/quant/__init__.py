"""Quantized AR checkpoints: where each compressed-tensors scheme runs, and runs fast (`schemes`; the scheme
table itself is the floor's `quant_scheme`), which AR checkpoint the engine serves (`policy`), the
llm-compressor exports (`export`, needs the `quantize` environment), the calibration corpus and the
quality gate.
"""
