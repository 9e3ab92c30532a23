"""GLM's clamped SwiGLU for the dense MLP (and the shared expert when it runs apart) in one launch.

The torch twin is kernels/moe.swiglu: silu(min(gate, limit)) * clamp(up, -limit, limit). `clamped_swiglu` is the
element formula every GPU path shares (fp32 math, SiLU rounded to the activation dtype before the product, the
product rounded again), so the dense path and the MoE kernels give a clamped SwiGLU the same bits, and all round
where the twin's two half-precision ops do.

gate and up come in as the two halves of one [S, T, 2I] projection output, so the kernel reads them through their
own leading strides instead of copying them contiguous first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import pdl
from kernels.gpu.pdl import wait_for_inputs


@triton.jit
def clamped_swiglu(g, u, limit, act: tl.constexpr):
    """silu(min(g, limit)) * clamp(u, -limit, limit) of fp32 g, u (already at the activation dtype's values), in
    `act`: SiLU rounded to `act` before the product, as the twin's two half-precision ops round. Every GPU path's
    clamped SwiGLU (this file's, the MoE's grouped gate|up, EXL3's rotations out) uses it, so all give one set of
    bits."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g * tl.sigmoid(g)).to(act).to(tl.float32)
    return (s * u).to(act)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_kernel(g_ptr, s_g_shard, s_g, u_ptr, s_u_shard, s_u, h_ptr, n_rows, width, limit,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One (row, block of BLOCK columns, shard): element by element, so a row's bits never depend on its company."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    shard = tl.program_id(2).to(tl.int64)
    mask = cols < width
    g = tl.load(g_ptr + shard * s_g_shard + row * s_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + shard * s_u_shard + row * s_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = clamped_swiglu(g, u, limit, h_ptr.dtype.element_ty)
    tl.store(h_ptr + (shard * n_rows + row) * width + cols, h, mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [S, T, I] (any leading strides, unit last) -> silu(min(gate, limit)) * clamp(up, -limit, limit)
    as a contiguous [S, T, I] in their dtype."""
    if gate.shape != up.shape or gate.dim() != 3 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("swiglu takes gate and up of one [S, T, I] shape with unit stride along I")
    shards, t, width = gate.shape
    out = torch.empty(shards, t, width, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width))
        _swiglu_kernel[(t, triton.cdiv(width, block), shards)](
            gate, gate.stride(0), gate.stride(1), up, up.stride(0), up.stride(1), out, t, width, float(limit),
            BLOCK=block, num_warps=4, **pdl.options())
    return out
