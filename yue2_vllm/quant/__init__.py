"""Quantized AR checkpoints: the compressed-tensors schemes and where they run fast (`schemes`), the
llm-compressor exports (`export`, needs the `quantize` environment), the calibration corpus and the
quality gate.
"""
