"""Row-wise normalisations on the GPU, one program per row (docs/design.md §5.1: norms run one program per row, so a row's
statistics are summed in the same order whatever the batch). Torch twins: kernels/norms.py.

torch's own reductions choose how many threads and blocks share a row from the tensor's shape, the row count
included, so their bits can move with the batch; these kernels fix the order: the whole row in one program.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.gpu import pdl
from kernels.gpu.pdl import wait_for_inputs


@triton.jit
def _rms_norm_row(x, w_ptr, c, mask, D, eps, act: tl.constexpr):
    """One row's RMSNorm: x [BLOCK] fp32 (0 past D) -> [BLOCK] in `act`."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0)
    # As the twin: normalise in fp32, round to the activation dtype, then apply the weight in that dtype.
    return (w.to(tl.float32) * (x * rstd).to(act).to(tl.float32)).to(act)


@triton.jit
def _rms_norm_kernel(x_ptr, s_x, w_ptr, out_ptr, s_out, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < D
    x = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + c, _rms_norm_row(x, w_ptr, c, mask, D, eps, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mean_rms_norm_kernel(x_ptr, s_x, s_n, inv_n, w_ptr, out_ptr, s_out, D, eps, N: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """RMSNorm of the mean of a row's N streams, as the torch ops it replaces: fp32 adds in stream order, times the
    fp32 reciprocal of N (torch on CUDA divides by a Python scalar that way), rounded to the activation dtype."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < D
    total = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(1, N):
        total = total + tl.load(x_ptr + row * s_x + i * s_n + c, mask=mask, other=0.0).to(tl.float32)
    act = out_ptr.dtype.element_ty
    x = (total * inv_n).to(act).to(tl.float32)
    tl.store(out_ptr + row * s_out + c, _rms_norm_row(x, w_ptr, c, mask, D, eps, act), mask=mask)


@triton.jit
def _layer_norm_kernel(x_ptr, s_x, w_ptr, b_ptr, out_ptr, s_out, D, eps, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < D
    x = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    diff = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + c, (diff * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _rms_warps(d: int) -> int:
    return 4 if d <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        d = x2.shape[1]
        _rms_norm_kernel[(x2.shape[0],)](x2, x2.stride(0), weight, out, out.stride(0), d, float(eps),
                                         BLOCK=triton.next_power_of_2(d), num_warps=_rms_warps(d), **pdl.options())
    return out.reshape(x.shape)


def mean_rms_norm(streams: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D] -> rms_norm(their mean over N) [T, D], in one launch and with rms_norm's bits (its row
    arithmetic and launch shape, so the same sum order)."""
    t, n, d = streams.shape
    assert streams.stride(-1) == 1
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        inv_n = float(np.float32(1.0) / np.float32(n))  # fp32, as torch computes a Python divisor's reciprocal on CUDA
        _mean_rms_norm_kernel[(t,)](streams, streams.stride(0), streams.stride(1), inv_n, weight, out, out.stride(0),
                                    d, float(eps), N=n, BLOCK=triton.next_power_of_2(d),
                                    num_warps=_rms_warps(d), **pdl.options())
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        d = x2.shape[1]
        _layer_norm_kernel[(x2.shape[0],)](x2, x2.stride(0), weight, bias, out, out.stride(0), d, float(eps),
                                           BLOCK=triton.next_power_of_2(d), num_warps=4, **pdl.options())
    return out.reshape(x.shape)
