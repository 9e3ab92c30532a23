"""Row-invariant matrix products.

torch's CPU GEMM picks a different algorithm for one row (GEMV) than for many, and for different row counts, so a
row's bits would depend on how many other rows share the batch. Running every product over fixed-size row tiles
(the last one zero-padded) makes each call see the same shape, so a row's result depends only on its own values.
On CUDA we use the plain product for now; the GPU path's row invariance is proven separately (tests/gpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16


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
