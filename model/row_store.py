"""One paged store of per-position cache rows, kept either in the compute dtype or in fp8 e4m3 + a per-row scale.

`--kv-cache-dtype` picks the storage (vLLM's spellings): `auto` keeps rows in the compute dtype; `fp8` /
`fp8_e4m3` stores e4m3 plus one fp32 scale per row (kernels/kv_quant.py), quantized on write and dequantized to
the compute dtype on read, so the attention code above never sees the storage format.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels.kv_quant import FP8, dequantize_rows, quantize_rows

# name -> storage dtype; None = the compute dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}
SCALE_DTYPE = torch.float32


def row_bytes(width: int, stored: torch.dtype) -> int:
    """Bytes one cached row of `width` values takes when stored as `stored` (with its scale, for fp8)."""
    scale = SCALE_DTYPE.itemsize if stored == FP8 else 0
    return width * stored.itemsize + scale


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, except on the CPU, where the memory comes from calloc (through numpy) and its pages are zeroed
    by the OS when first touched: a pool sized for the whole window then takes resident memory only as it fills,
    instead of all of it at start (torch.zeros writes every byte)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class RowStore:
    def __init__(self, num_blocks: int, block_size: int, width: int, *, dtype: torch.dtype,
                 stored: torch.dtype | None, device: torch.device | str) -> None:
        self.dtype = dtype  # what reads return
        self.width = width
        self.data = zeroed((num_blocks, block_size, width), stored or dtype, device)
        self.scale = (torch.ones(num_blocks, block_size, dtype=SCALE_DTYPE, device=device)
                      if self.data.dtype == FP8 else None)

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """Store values[i] ([n, width]) at (blocks[i], offsets[i])."""
        if self.scale is None:
            self.data[blocks, offsets] = values.to(self.data.dtype)
            return
        q, scale = quantize_rows(values)
        self.data[blocks, offsets] = q
        self.scale[blocks, offsets] = scale

    def read(self, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` rows of the given blocks, in order, in the compute dtype -> [length, width]."""
        rows = self.data[block_ids].flatten(0, 1)[:length]
        if self.scale is None:
            return rows
        return dequantize_rows(rows, self.scale[block_ids].flatten(0, 1)[:length], self.dtype)

    def gather(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows at (blocks, offsets) (any matching shapes) in the compute dtype -> [*shape, width]."""
        rows = self.data[blocks, offsets]
        if self.scale is None:
            return rows
        return dequantize_rows(rows, self.scale[blocks, offsets], self.dtype)
