"""Row-invariant matrix products, and the row padding that keeps elementwise ops row-invariant.

torch's CPU GEMM picks a different algorithm for one row (GEMV) than for many, and for different row counts, so a
row's bits would depend on how many other rows share the batch. Running every product over fixed-size row tiles
(the last one zero-padded) makes each call see the same shape, so a row's result depends only on its own values.

Elementwise transcendental ops (exp, sigmoid, SiLU, rsqrt) have the same problem in a subtler form: torch's CPU
kernels compute whole SIMD steps with one code path and the leftover tail elements with another, so a row that
lands in the tail gets different bits. Keeping every batch-wide tensor at a multiple of ROW_TILE rows (`pad_rows`)
means there is never a tail. On CUDA we use the plain product for now; GPU row invariance is a later step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per GEMM tile and the padding multiple of batch-wide tensors. torch's AVX-512 elementwise kernels step two
# 16-float vectors at a time and finish the remainder on a different path; 64 rows keeps every tensor of width >= 1
# a whole number of steps (measured: 16 is not enough for sigmoid/SiLU on one-column tensors, 32 and 64 are).
ROW_TILE = 64


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` over the last dim of x, with a row-count-independent result on CPU."""
    if x.device.type != "cpu":
        return F.linear(x, weight)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 0:
        return x.new_zeros(*lead, weight.shape[0])
    pad = (-n) % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([F.linear(rows[i : i + ROW_TILE], weight) for i in range(0, rows.shape[0], ROW_TILE)])
    return out[:n].reshape(*lead, weight.shape[0])


def pad_rows(x: torch.Tensor, multiple: int = ROW_TILE) -> torch.Tensor:
    """x with zero rows appended so its row count is a multiple of `multiple` (see the module note)."""
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` returned in fp32. On CUDA with bf16/fp16 operands the GEMM writes its fp32 accumulator
    directly (no rounding of the result to 16 bits): row-parallel partials and logits are summed and compared in
    fp32, so rounding them first would throw away bits for nothing."""
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        lead = x.shape[:-1]
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return out.reshape(*lead, weight.shape[0])
    return linear(x, weight).float()
