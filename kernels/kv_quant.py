"""FP8 (e4m3) cache rows with one fp32 scale per row: the torch reference.

Each cached row (one position's latent, or its indexer key + gate) is scaled so its largest magnitude maps to
e4m3's largest finite value (448). The scale depends on that row alone, so a row's stored bits never depend on
which rows were written with it (docs/design.md §5.2), and every step is elementwise or a max (exact in any order), so
every rank and every batch shape stores the same bits.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values: [..., d] -> (e4m3 [..., d], fp32 scale [...]) with values ~= e4m3 * scale."""
    x = values.float()
    amax = x.abs().amax(dim=-1)
    # An all-zero row would divide by zero; any positive scale stores it exactly, 1 is as good as any.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # x / scale can land a rounding step above 448, which e4m3fn (no inf) would turn into NaN: clamp first.
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows` (up to e4m3 rounding): (e4m3 [..., d], fp32 [...]) -> `dtype` [..., d]."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
