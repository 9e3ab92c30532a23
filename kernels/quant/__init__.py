"""Quantized weight formats, each with a torch reference (the CPU compute path and the GPU kernels' parity oracle).

- fp8.py:   FP8 e4m3, 128x128 block scales (DeepSeek-V3 style) or per-channel scales — Hopper dense + attention
- w4a16.py: symmetric int4 in groups of 128 along the input dim, float16 scales — Hopper experts
- intn.py:  symmetric 2 / 3 / 4 / 8-bit integers in groups along the input dim, signed bfloat16 scales
- bitstream.py: the int32 little-endian bit stream both integer formats pack their codes into
- exl3.py:  exllamav3's trellis format (decode; exl3_encode.py: a torch beam-search encoder) — the seed's format
- codec.py: what each format answers (names, shape, tensor-parallel cuts, dequantize); weight.py: `QuantizedWeight`
"""

from kernels.quant.weight import BY_METHOD, CODECS, QuantizedWeight, codec_of, quantize, quantized_modules, random_quantized

__all__ = ["BY_METHOD", "CODECS", "QuantizedWeight", "codec_of", "quantize", "quantized_modules",
           "random_quantized"]
