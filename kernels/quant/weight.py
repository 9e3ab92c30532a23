"""`QuantizedWeight`: one linear's stored tensors in a quantized format, with its logical [out, in] shape.

`dequantize(dtype)` is the reference path (the CPU computes with its result; GPU kernels are checked against it).
`cut(dim, part)` is a tensor-parallel shard of it, taken from the stored tensors on the format's tile grid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.quant import exl3, exl3_encode, fp8, intn, w4a16
from kernels.quant.codec import Codec

CODECS: dict[str, Codec] = {c.name: c for c in (fp8.CODEC, w4a16.CODEC, intn.CODEC, exl3.CODEC)}
BY_METHOD: dict[str, Codec] = {c.quant_method: c for c in CODECS.values()}
DtypeOf = Callable[[str], torch.dtype]  # a stored tensor's dtype, by its checkpoint key


def codec_of(names: Mapping[str, str], dtype_of: DtypeOf) -> Codec | None:
    """The format of a module whose stored tensors are `names` ({tensor name: key}); None: not a quantized linear.
    `dtype_of` is asked only where two formats store the same names (w4a16 and int: their scales' dtypes)."""
    for c in CODECS.values():
        if c.stores(set(names), lambda n: dtype_of(names[n])):
            return c
    return None


def quantized_modules(keys: Iterable[str], dtype_of: DtypeOf) -> dict[str, tuple[Codec, dict[str, str]]]:
    """Checkpoint keys -> each quantized module (`X` of `X.trellis`, ...): its codec and {tensor name: key}."""
    modules: dict[str, dict[str, str]] = {}
    for k in keys:
        module, _, name = k.rpartition(".")
        modules.setdefault(module, {})[name] = k
    return {m: (c, names) for m, names in modules.items() if (c := codec_of(names, dtype_of)) is not None}


@dataclass(frozen=True)
class QuantizedWeight:
    format: str  # a key of CODECS: "fp8" | "w4a16" | "int" | "exl3"
    tensors: dict[str, torch.Tensor]  # stored tensors by name (the part after `X.`)
    shape: tuple[int, int]  # logical [out, in] of the dense weight
    params: Mapping[str, Any] = field(default_factory=dict)  # the format's parameters (block, group, bits, codebook)

    @classmethod
    def from_tensors(cls, format: str, tensors: dict[str, torch.Tensor],
                     qcfg: Mapping[str, Any] | None = None) -> "QuantizedWeight":
        codec = CODECS[format]
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        params = codec.params(qcfg, shapes)
        return cls(format, tensors, codec.logical_shape(shapes, params), params)

    @property
    def codec(self) -> Codec:
        return CODECS[self.format]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.codec.dequantize(self.tensors, self.shape, self.params).to(dtype)

    def cut(self, dim: int, part: slice, what: str = "weight") -> "QuantizedWeight":
        """Rows (dim 0) or columns (dim 1) `part` of the logical weight; raises ValueError off the tile grid."""
        self.codec.check_cut(dim, part, self.shape[dim], self.params, what)
        tensors = {}
        for name, t in self.tensors.items():
            index = self.codec.cut(name, dim, part, self.params)
            tensors[name] = t if index is None else t[index].contiguous()
        shape = list(self.shape)
        shape[dim] = part.stop - part.start
        return QuantizedWeight(self.format, tensors, (shape[0], shape[1]), self.params)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.format, {k: v.to(device) for k, v in self.tensors.items()}, self.shape, self.params)


def quantize(w: torch.Tensor, format: str, *, block: int | None = None, bits: float | None = None,
             codebook: str = "mul1", generator: torch.Generator | None = None) -> QuantizedWeight:
    """Quantize a dense [out, in] weight: fp8 with [block, block] scales (None = one scale per output channel),
    w4a16 with groups of `block` (None = 128), int at `bits` (2, 3, 4, 8; default 4) in groups of `block` (None =
    128), or EXL3 at `bits` (default 4) with `codebook` (exl3_encode.py's beam search; `generator` draws its sign
    vectors)."""
    if format == "fp8":
        tensors = fp8.quantize_channels(w) if block is None else fp8.quantize_blocks(w, (block, block))
        return QuantizedWeight.from_tensors("fp8", tensors, {"weight_block_size": [block, block]} if block else None)
    if format == "w4a16":
        group = block or w4a16.DEFAULT_GROUP
        return QuantizedWeight.from_tensors("w4a16", w4a16.quantize(w, group), {"group_size": group})
    if format == "int":
        group = block or intn.DEFAULT_GROUP
        return QuantizedWeight.from_tensors("int", intn.quantize(w, _int_bits(bits), group), {"group_size": group})
    if format == "exl3":
        return QuantizedWeight.from_tensors("exl3", exl3_encode.quantize(w, bits or 4, codebook, generator=generator))
    raise ValueError(f"unknown format {format!r} (one of {', '.join(CODECS)})")


def random_quantized(format: str, out: int, inp: int, *, std: float, block: int | None = 128,
                     bits: float | None = None, codebook: str = "mul1", generator: torch.Generator | None = None,
                     device: torch.device | str = "cpu") -> QuantizedWeight:
    """A random [out, in] linear drawn directly in `format` (no dense copy) with about `std` per dense element.
    block: fp8's square block (None = per channel) / w4a16's and int's group; bits: int's (2, 3, 4, 8) and EXL3's
    (default 4 for both); codebook: EXL3's."""
    kw = dict(std=std, generator=generator, device=device)
    if format == "fp8":
        tensors = fp8.random_linear(out, inp, block=(block, block) if block else None, **kw)
        return QuantizedWeight.from_tensors(format, tensors, {"weight_block_size": [block, block]} if block else None)
    if format == "w4a16":
        return QuantizedWeight.from_tensors(format, w4a16.random_linear(out, inp, group=block or 128, **kw))
    if format == "int":
        group = block or intn.DEFAULT_GROUP
        return QuantizedWeight.from_tensors(format, intn.random_linear(out, inp, bits=_int_bits(bits), group=group,
                                                                       **kw), {"group_size": group})
    if format == "exl3":
        return QuantizedWeight.from_tensors(format, exl3.random_linear(out, inp, bits=bits or 4, codebook_name=codebook,
                                                                       **kw))
    raise ValueError(f"unknown format {format!r} (one of {', '.join(CODECS)})")


def _int_bits(bits: float | None) -> int:
    """The int format's width from a `bits` argument (None: 4), refusing a fraction."""
    if bits is None:
        return 4
    if bits != int(bits):
        raise ValueError(f"int: {bits:g} bits per weight; the int formats have {', '.join(map(str, intn.BITS))}")
    return int(bits)
