"""W4A16: 4-bit weights in groups along the input dim with one float16 scale per group, 16-bit activations.
Torch reference (quantize and dequantize), which is also the CPU compute path and the parity oracle of the GPU's
fused W4A16 MoE kernel.

Symmetric int4, no zero points: q = round(W / s) clamped to [-8, 7] with s = amax(group) / 7 (rounded to float16
first, so dequantization uses exactly the scale quantization divided by); W ~= q * s. Symmetric because a kernel then
needs one multiply per group and no zero-point tensor; 4-bit experts lose little to it (GPTQ / Marlin `sym=True`).

Storage of a linear `X` with dense weight W [out, in] (tensor names as compressed-tensors' "pack-quantized"):
- `X.weight_packed` int32 [out, in / 8]: word [n, j] holds W[n, 8j + i] in bits 4i..4i+3 (i = 0..7, lowest nibble
  first) as the unsigned nibble q + 8 (bitstream.py's 4-bit stream, the int format's at 4 bits). The input dim is
  contiguous, so a kernel reads 8 consecutive K values of one output row with a single 32-bit load, and a
  [BLOCK_N, BLOCK_K] tile is [BLOCK_N, BLOCK_K / 8] words.
- `X.weight_scale` float16 [out, in / group] (float16 tells it from the int format, whose scales are bfloat16).
`quantization_config = {"quant_method": "twinspark_w4a16", "bits": 4, "group_size": G, "symmetric": true,
"pack": "int32: 8 nibbles along in, lowest first, q + 8"}`; `in` must be a multiple of the group size and of 8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kernels.quant import bitstream, intn
from kernels.quant.codec import Codec, Index, Params, axis_index

QUANT_METHOD = "twinspark_w4a16"
DEFAULT_GROUP = 128
BITS = 4
PER_WORD = 8  # nibbles per int32
QMIN, QMAX = -8, 7
OFFSET = 8  # stored nibble = q + OFFSET
SCALE_DTYPE = torch.float16


def _check_group(inp: int, group: int) -> None:
    if group % PER_WORD or inp % group:
        raise ValueError(f"w4a16: the input dim {inp} must be a multiple of the group size {group}, itself a "
                         f"multiple of {PER_WORD}")


def pack(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [out, in] -> int32 [out, in / 8] (layout in the module note)."""
    return bitstream.pack(q.to(torch.int64) + OFFSET, BITS)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 values in [-8, 7], [out, in]."""
    return (bitstream.unpack(packed, BITS) - OFFSET).to(torch.int8)


def quantize(w: torch.Tensor, group: int = DEFAULT_GROUP) -> dict[str, torch.Tensor]:
    """W [out, in] -> {"weight_packed", "weight_scale"}."""
    out, inp = w.shape
    _check_group(inp, group)
    g = w.float().view(out, inp // group, group)
    scale = (g.abs().amax(-1) / QMAX).to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp_(QMIN, QMAX).view(out, inp)
    return {"weight_packed": pack(q), "weight_scale": scale}


def random_linear(out: int, inp: int, *, std: float, group: int = DEFAULT_GROUP,
                  generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """W4A16 tensors of a random [out, in] linear whose dense weight has about `std` per element: the int format's
    4-bit draw (nibbles uniform in [-8, 7]) with float16 scales."""
    _check_group(inp, group)
    return intn.random_linear(out, inp, bits=BITS, std=std, group=group, generator=generator, device=device,
                              scale_dtype=SCALE_DTYPE)


class W4A16Codec(Codec):
    name = "w4a16"
    quant_method = QUANT_METHOD
    required = frozenset({"weight_packed", "weight_scale"})
    dtypes = {"weight_scale": SCALE_DTYPE}

    def params(self, qcfg: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        out, words = shapes["weight_packed"]
        inp = words * PER_WORD
        groups = shapes["weight_scale"][1]
        group = int((qcfg or {}).get("group_size") or inp // groups)
        _check_group(inp, group)
        if tuple(shapes["weight_scale"]) != (out, inp // group):
            raise ValueError(f"w4a16 scales {tuple(shapes['weight_scale'])} do not fit a [{out}, {inp}] weight in "
                             f"groups of {group} (expected [{out}, {inp // group}])")
        return {"group": group}

    def logical_shape(self, shapes: Mapping[str, tuple[int, ...]], params: Params) -> tuple[int, int]:
        out, words = shapes["weight_packed"]
        return int(out), int(words) * PER_WORD

    def tile(self, dim: int, params: Params) -> int:
        return 1 if dim == 0 else params["group"]

    def cut(self, name: str, dim: int, part: slice, params: Params) -> Index | None:
        if dim == 0:
            return axis_index(0, part)
        step = PER_WORD if name == "weight_packed" else params["group"]
        return axis_index(1, slice(part.start // step, part.stop // step))

    def dequantize(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int], params: Params) -> torch.Tensor:
        q = unpack(tensors["weight_packed"]).float()
        return q * tensors["weight_scale"].float().repeat_interleave(params["group"], 1)


CODEC = W4A16Codec()
