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
# 1 / 448 in fp32 (what torch on CUDA multiplies by when it divides a tensor by the Python scalar 448).
INV_FP8_MAX = (torch.tensor(1.0) / FP8_MAX).item()


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values: [..., d] -> (e4m3 [..., d], fp32 scale [...]) with values ~= e4m3 * scale."""
    x = values.float()
    amax = x.abs().amax(dim=-1)
    # An all-zero row would divide by zero; any positive scale stores it exactly, 1 is as good as any. The scale is
    # amax times the fp32 reciprocal, not amax / 448: torch on CUDA turns a division by a Python scalar into that
    # product and the CPU divides, so spelt as a product every device (and kernels/gpu/rows.py) stores the same bits.
    scale = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    # x / scale can land a rounding step above 448, which e4m3fn (no inf) would turn into NaN: clamp first.
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows` (up to e4m3 rounding): (e4m3 [..., d], fp32 [...]) -> `dtype` [..., d]."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
