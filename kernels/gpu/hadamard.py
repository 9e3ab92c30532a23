"""Row-wise 128-point Hadamard transforms, EXL3's input and output rotations on the activation side.

EXL3 stores W [out, in] = diag(svh) . H . T^T . H . diag(suh) / 128 (kernels/quant/exl3.py; H the unnormalised
128-Sylvester matrix per block, symmetric), so y = x W^T = had(had(x * suh) @ T) * svh / 128: the GEMM reads the
decoded trellis tiles T as they are and these kernels rotate the rows around it.
- `rotate_in`: u = had(x * suh) / 8, rounded to the GEMM's operand dtype (float16 for half activations: T's values
  are float16 codebook entries, exact there and not in bfloat16; float32 for float32 activations).
- `rotate_out`: y = had(acc) * svh / 16 from the GEMM's float32 accumulator. 1/8 * 1/16 = 1/128 (powers of two:
  exact scalings; 1/8 keeps the rotated rows near the input's magnitude, had() grows a block by sqrt(128)).

Exactness (docs/design.md §5.1): each program transforms whole 128-blocks of BLOCK_R rows with one fixed butterfly order
(the twin's `fwht`: pairs (i, i + h) for h = 1, 2, ..., 64, (a + b, a - b)) in float32, so a row's result depends on
that row only, never on how many rows share the call. Rows can be gathered (`src_rows`: MoE slots read their
token's row), take their sign/scale vector from a stack (`vec_rows`: each slot its expert's), be scattered
(`out_rows`) and scaled (`row_weight`: a routing weight); index -1 (or a vector row past the stack) = no row.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

HAD = 128
_BLOCK_R = 16  # rows per program (a power of two; any value gives the same bits per row)
IN_SCALE = 1.0 / 8
OUT_SCALE = 1.0 / 16
# Triton's CPU interpreter has no libdevice; it never contracts a multiply into an add either.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _butterfly(v, R: tl.constexpr, H: tl.constexpr):
    """One stage on [R, 128]: within each run of 2H columns, (a, b) = (col i, col i + H) -> (a + b, a - b)."""
    v = tl.permute(tl.reshape(v, (R, 128 // (2 * H), 2, H)), (0, 1, 3, 2))
    a, b = tl.split(v)
    v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(v, (R, 128))


@triton.jit
def had128(v, R: tl.constexpr):
    """Unnormalised Hadamard transform of each row of a float32 [R, 128] block (the twin's stage order)."""
    v = _butterfly(v, R, 1)
    v = _butterfly(v, R, 2)
    v = _butterfly(v, R, 4)
    v = _butterfly(v, R, 8)
    v = _butterfly(v, R, 16)
    v = _butterfly(v, R, 32)
    return _butterfly(v, R, 64)


@triton.jit
def _rotate_kernel(src_ptr, vec_ptr, out_ptr, src_rows_ptr, vec_rows_ptr, out_rows_ptr, weight_ptr,
                   R, C, V, rows_per_vec, ssr, svr, sor, scale,
                   PRE: tl.constexpr, SRC_ROWS: tl.constexpr, VEC_ROWS: tl.constexpr, OUT_ROWS: tl.constexpr,
                   WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, ROUNDED_MUL: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    in_range = r < R
    srow = tl.load(src_rows_ptr + r, mask=in_range, other=-1) if SRC_ROWS else r
    vrow = tl.load(vec_rows_ptr + r, mask=in_range, other=V) if VEC_ROWS else r // rows_per_vec
    orow = tl.load(out_rows_ptr + r, mask=in_range, other=-1) if OUT_ROWS else r
    live = in_range & (srow >= 0) & (vrow < V) & (orow >= 0)
    srow = tl.where(live, srow, 0).to(tl.int64)
    vrow = tl.where(live, vrow, 0).to(tl.int64)
    orow = tl.where(live, orow, 0).to(tl.int64)
    m = live[:, None]
    x = tl.load(src_ptr + srow[:, None] * ssr + c[None, :], mask=m, other=0.0).to(tl.float32)
    vec = tl.load(vec_ptr + vrow[:, None] * svr + c[None, :], mask=m, other=0.0).to(tl.float32)
    if PRE:  # input side: sign/scale, then rotate
        # The product rounded on its own, as the twin's is: the compiler may otherwise fuse it into the first
        # butterfly's add (an fma: one rounding fewer, other bits). mul_rn is never contracted.
        if ROUNDED_MUL:
            x = libdevice.mul_rn(x, vec)
        else:
            x = x * vec
        y = had128(x, BLOCK_R) * scale
    else:  # output side: rotate, then sign/scale
        y = had128(x, BLOCK_R) * (vec * scale)
    if WEIGHT:
        y = y * tl.load(weight_ptr + orow, mask=live, other=0.0)[:, None]
    if OUT_ROWS:  # scattered rows: only live ones are written
        tl.store(out_ptr + orow[:, None] * sor + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
    else:  # dense rows: dead ones (empty MoE slots) become 0
        tl.store(out_ptr + r.to(tl.int64)[:, None] * sor + c[None, :], tl.where(m, y, 0.0).to(out_ptr.dtype.element_ty),
                 mask=in_range[:, None])


def _rows(src: torch.Tensor, vec: torch.Tensor, out: torch.Tensor, pre: bool, scale: float,
          src_rows: torch.Tensor | None, vec_rows: torch.Tensor | None, out_rows: torch.Tensor | None,
          row_weight: torch.Tensor | None, rows_per_vec: int) -> torch.Tensor:
    r = out.shape[0] if out_rows is None else out_rows.shape[0]
    c = src.shape[1]
    if c % HAD or vec.shape[-1] != c or src.stride(1) != 1 or out.stride(1) != 1 or vec.stride(-1) != 1:
        raise ValueError(f"rotate: rows of {c} (a multiple of {HAD}, unit stride) with vectors {list(vec.shape)}")
    vec2 = vec.reshape(-1, c)
    dummy = torch.empty(1, dtype=torch.int32, device=src.device)
    if r:
        _rotate_kernel[(triton.cdiv(r, _BLOCK_R), c // HAD)](
            src, vec2, out, dummy if src_rows is None else src_rows, dummy if vec_rows is None else vec_rows,
            dummy if out_rows is None else out_rows, out if row_weight is None else row_weight,
            r, c, vec2.shape[0], max(rows_per_vec, 1), src.stride(0), vec2.stride(0), out.stride(0), float(scale),
            PRE=pre, SRC_ROWS=src_rows is not None, VEC_ROWS=vec_rows is not None, OUT_ROWS=out_rows is not None,
            WEIGHT=row_weight is not None, BLOCK_R=_BLOCK_R, ROUNDED_MUL=not _INTERPRETED)
    return out


def operand_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype EXL3's GEMM multiplies in for activations of dtype `act` (see the module note)."""
    return torch.float32 if act == torch.float32 else torch.float16


def rotate_in(x: torch.Tensor, suh: torch.Tensor, *, rows: int | None = None, src_rows: torch.Tensor | None = None,
              vec_rows: torch.Tensor | None = None, rows_per_vec: int | None = None) -> torch.Tensor:
    """had(x[row] * suh[vector of row]) / 8 per row -> [rows, C] in `operand_dtype(x.dtype)`.

    x [R, C]; suh [V, C] (or [C]). Rows are x's own unless `src_rows` gathers them; the vector of output row r is
    `vec_rows[r]` or r // rows_per_vec (default: all rows share suh[0])."""
    n = rows if rows is not None else (src_rows.shape[0] if src_rows is not None else x.shape[0])
    out = torch.empty(n, x.shape[1], dtype=operand_dtype(x.dtype), device=x.device)
    return _rows(x, suh, out, True, IN_SCALE, src_rows, vec_rows, None, None, rows_per_vec or max(n, 1))


def rotate_out(acc: torch.Tensor, svh: torch.Tensor, out_dtype: torch.dtype, *, vec_rows: torch.Tensor | None = None,
               rows_per_vec: int | None = None, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
               row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """had(acc[row]) * svh[vector of row] / 16 (* row_weight[out row]) per row of a float32 [R, C] accumulator.

    Written to `out` (new [R, C] if None) at row r, or at `out_rows[r]` (rows with index -1 skipped)."""
    if out is None:
        out = torch.empty(acc.shape[0], acc.shape[1], dtype=out_dtype, device=acc.device)
    return _rows(acc, svh, out, False, OUT_SCALE, None, vec_rows, out_rows, row_weight,
                 rows_per_vec or max(acc.shape[0], 1))
