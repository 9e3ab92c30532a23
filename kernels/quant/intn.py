"""Integer weights: symmetric 2-, 3-, 4- or 8-bit codes in groups along the input dim, one bfloat16 scale per group.
Torch reference (quantize, dequantize, random draw), which is also the CPU compute path and the parity oracle of
the GPU kernels that read this format.

Values: q in [-2^(bits-1), 2^(bits-1) - 1], W ~= q * s, no zero points. The scale is signed: a group's element of
largest magnitude m (the first one on ties) gets s = bfloat16(-m / 2^(bits-1)), so m lands exactly on the bottom
level -2^(bits-1) (up to s's rounding) and all 2^bits levels are in use; an unsigned amax / (2^(bits-1) - 1) scale
would leave the bottom level empty, a quarter of the levels at 2 bits. humming-kernels quantizes its symmetric
weights the same way. The opposite end gives up half a level: an element near -m lands past the top level and is
clamped there, off by up to one step. q = clamp(round(W / s)) divides by the bfloat16 scale as stored, so
dequantization multiplies by exactly the scale quantization used; a group of zeros gets s = 1. q * s is exact in
float32 (a bfloat16 times an integer of at most 8 bits), so dequantize(cut) == cut(dequantize) bit for bit.

Storage of a linear `X` with dense weight W [out, in] (compressed-tensors' "pack-quantized" names):
- `X.weight_packed` int32 [out, in * bits / 32]: each row's codes q + 2^(bits-1) (0 .. 2^bits - 1) as one
  little-endian bit stream (bitstream.py: element i in stream bits [i * bits, (i + 1) * bits), word j holding
  stream bits [32 j, 32 j + 32)); at 4 bits this is W4A16's packing, nibble for nibble.
- `X.weight_scale` bfloat16 [out, in / G] (bfloat16 tells it from W4A16, whose scales are float16).
A group is whole words (G * bits a multiple of 32: any multiple of 32 at every width, of 16 at 2 bits, of 8 at 4
bits, of 4 at 8 bits) and `in` is whole groups. One group size per checkpoint, in `quantization_config`
(`quant_config`); the bits may differ per linear (int3 experts + int4 attention) and are read off the shapes:
bits = words * 32 / (groups * G).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kernels.quant import bitstream
from kernels.quant.codec import Codec, Index, Params, axis_index

QUANT_METHOD = "twinspark_int"
BITS = (2, 3, 4, 8)
DEFAULT_GROUP = 128
SCALE_DTYPE = torch.bfloat16


def quant_config(group: int) -> dict[str, Any]:
    """The `quantization_config` of a checkpoint whose int linears are in groups of `group`."""
    return {"quant_method": QUANT_METHOD, "group_size": group, "symmetric": True, "format": "pack-quantized",
            "pack": "int32 LSB-first bitstream of q + 2^(bits-1) along the input dim"}


def levels(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of a `bits`-bit code."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def uniform_std(bits: int) -> float:
    """The std of q drawn uniformly over its 2^bits levels."""
    return ((4**bits - 1) / 12) ** 0.5


def check_group(bits: int, group: int, inp: int | None = None) -> None:
    """Raise a ValueError unless `bits` is a width this format has, a group of `group` is whole int32 words, and
    an input dim `inp` (when given) is whole groups."""
    if bits not in BITS:
        raise ValueError(f"int: {bits} bits per weight; the int formats have {', '.join(map(str, BITS))}")
    smallest = bitstream.period(bits)[0]
    if group < 1 or group * bits % bitstream.WORD:
        raise ValueError(f"int{bits}: groups of {group} do not fill whole int32 words: the group size times the bits "
                         f"must be a multiple of 32 (int{bits}: a multiple of {smallest}, e.g. 32, 64 or 128)")
    if inp is not None and inp % group:
        raise ValueError(f"int{bits}: the input dim {inp} is not whole groups of {group} (it must be a multiple of "
                         f"the group size)")


def quantize(w: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> dict[str, torch.Tensor]:
    """W [out, in] -> {"weight_packed", "weight_scale"}: round to nearest with signed scales (module note)."""
    out, inp = w.shape
    check_group(bits, group, inp)
    qmin, qmax = levels(bits)
    g = w.float().view(out, inp // group, group)
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)  # argmax: the first on ties
    scale = (extreme / qmin).to(SCALE_DTYPE)
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp_(qmin, qmax).view(out, inp)
    return {"weight_packed": bitstream.pack(q.to(torch.int64) - qmin, bits), "weight_scale": scale}


def random_linear(out: int, inp: int, *, bits: int, std: float, group: int = DEFAULT_GROUP,
                  generator: torch.Generator | None = None, device: torch.device | str = "cpu",
                  scale_dtype: torch.dtype = SCALE_DTYPE) -> dict[str, torch.Tensor]:
    """The tensors of a random [out, in] linear whose dense weight has about `std` per element: random codes
    (uniform over the 2^bits levels) and every scale std / uniform_std(bits), in `scale_dtype` (W4A16 draws its
    float16-scaled int4 here too). Drawn on `device`, never as a dense copy."""
    check_group(bits, group, inp)
    scale = torch.full((out, inp // group), std / uniform_std(bits), dtype=scale_dtype, device=device)
    return {"weight_packed": bitstream.random_words(out, inp, bits, generator=generator, device=device),
            "weight_scale": scale}


class IntCodec(Codec):
    name = "int"
    quant_method = QUANT_METHOD
    required = frozenset({"weight_packed", "weight_scale"})
    dtypes = {"weight_scale": SCALE_DTYPE}

    def params(self, qcfg: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        group = (qcfg or {}).get("group_size")
        if not group:
            raise ValueError("int: no group size: it comes from quantization_config.group_size (quant_method "
                             f"{QUANT_METHOD!r}), or {{'group_size': G}} where there is no config")
        group = int(group)
        (out, words), (scale_rows, groups) = shapes["weight_packed"], shapes["weight_scale"]
        bits, rest = divmod(words * bitstream.WORD, groups * group)
        if scale_rows != out or rest or bits not in BITS:
            raise ValueError(f"int: packed words [{out}, {words}] and scales [{scale_rows}, {groups}] in groups of "
                             f"{group} are no int format: the scales must be [out, in / {group}] and the words "
                             f"[out, in * bits / 32] for bits in {', '.join(map(str, BITS))} (here "
                             f"{words * bitstream.WORD / (groups * group):g} bits per weight)")
        check_group(bits, group)
        return {"bits": bits, "group": group}

    def logical_shape(self, shapes: Mapping[str, tuple[int, ...]], params: Params) -> tuple[int, int]:
        out, groups = shapes["weight_scale"]
        return int(out), int(groups) * params["group"]

    def tile(self, dim: int, params: Params) -> int:
        return 1 if dim == 0 else params["group"]

    def cut(self, name: str, dim: int, part: slice, params: Params) -> Index | None:
        if dim == 0:
            return axis_index(0, part)
        if name == "weight_packed":  # columns on the group grid start and end on word boundaries
            bits = params["bits"]
            return axis_index(1, slice(part.start * bits // bitstream.WORD, part.stop * bits // bitstream.WORD))
        return axis_index(1, slice(part.start // params["group"], part.stop // params["group"]))

    def dequantize(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int], params: Params) -> torch.Tensor:
        qmin, _ = levels(params["bits"])
        q = bitstream.unpack(tensors["weight_packed"], params["bits"]) + qmin
        return q.float() * tensors["weight_scale"].float().repeat_interleave(params["group"], 1)


CODEC = IntCodec()
