"""What every weight storage format answers: how a linear is stored, cut for tensor parallelism, and dequantized.

One `Codec` per format (fp8.py, w4a16.py, intn.py, exl3.py). A linear whose HF weight is `X.weight` of logical shape
[out, in] is stored as tensors `X.<name>` for the names its codec lists; `QuantizedWeight` (weight.py) holds them.
The loader cuts a tensor-parallel shard out of the stored tensors without dequantizing (`cut`), which is only
possible on the format's tile grid (`tile`): a cut elsewhere would need bits that belong to the next tile.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch

Params = Mapping[str, Any]
Index = tuple[slice, ...]


class Codec(ABC):
    name: str  # the format's name, as in QuantizedWeight.format
    quant_method: str  # `quantization_config.quant_method` of a checkpoint in this format
    required: frozenset[str]  # stored tensor names (after `X.`) that identify the format
    optional: frozenset[str] = frozenset()
    # Stored dtypes by tensor name that tell this format from another storing the same names (w4a16 and int both
    # store compressed-tensors' weight_packed + weight_scale, with float16 and bfloat16 scales).
    dtypes: Mapping[str, torch.dtype] = {}

    def stores(self, names: set[str], dtype: Callable[[str], torch.dtype]) -> bool:
        """True when a module whose stored tensor names are `names` is stored in this format; `dtype(name)` is a
        stored tensor's dtype, asked only for the names in `dtypes`."""
        return self.required <= names and all(dtype(n) == d for n, d in self.dtypes.items())

    @abstractmethod
    def params(self, qcfg: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """The format's parameters for one linear, from its `quantization_config` (None when the checkpoint's config
        does not describe this format) and its stored shapes; raises ValueError when they do not fit."""

    @abstractmethod
    def logical_shape(self, shapes: Mapping[str, tuple[int, ...]], params: Params) -> tuple[int, int]:
        """The dense weight's [out, in]."""

    @abstractmethod
    def tile(self, dim: int, params: Params) -> int:
        """A tensor-parallel cut along `dim` (0 = out, 1 = in) must start (and end, unless at the end) on a
        multiple of this."""

    @abstractmethod
    def cut(self, name: str, dim: int, part: slice, params: Params) -> Index | None:
        """Index into stored tensor `name` that holds logical rows (dim 0) / columns (dim 1) `part`; None = the
        whole tensor belongs to every part (e.g. per-row scales on a column cut)."""

    @abstractmethod
    def dequantize(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int], params: Params) -> torch.Tensor:
        """The dense [out, in] weight in float32, computed only with elementwise operations whose result for an
        element does not depend on the tensor's size, so dequantize(cut) == cut(dequantize) bit for bit."""

    def check_cut(self, dim: int, part: slice, size: int, params: Params, what: str) -> None:
        """Raise a ValueError naming the tile size when `part` of a dimension of `size` is not whole tiles."""
        t = self.tile(dim, params)
        if part.start % t or (part.stop % t and part.stop != size):
            side = "output rows" if dim == 0 else "input columns"
            raise ValueError(
                f"{what}: {self.name} stores {side} in tiles of {t}, so a tensor-parallel shard must start and end "
                f"on a multiple of {t}; shard [{part.start}:{part.stop}) of {size} does not (use fewer virtual "
                f"shards, or quantize with a smaller block / group size)")


def axis_index(dim: int, part: slice) -> Index:
    """Index of `part` along dim 0 or dim 1 of a 2-D tensor."""
    return (part,) if dim == 0 else (slice(None), part)


def tiles_of(part: slice, t: int) -> slice:
    """The tiles of size `t` that hold `part` (its start on the grid; its end on the grid or at the tensor's end)."""
    return slice(part.start // t, -(-part.stop // t))
