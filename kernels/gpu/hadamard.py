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
token's row) and take their sign/scale vector from a stack (`vec_rows`: each slot its expert's; a second stack for a
second output in the same launch: gate's and up's); index -1 (or a vector row past the stack) = no row, written as
0. `rotate_out_swiglu` ends a gate / up pair with the SwiGLU (and the next product's rotation in) in one launch;
kernels/gpu/moe.py's rotated combine ends down's product.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.gpu import pdl
from kernels.gpu.pdl import wait_for_inputs
from kernels.gpu.swiglu import clamped_swiglu

HAD = 128
_BLOCK_R = 16  # rows per program (a power of two; any value gives the same bits per row)
IN_SCALE = 1.0 / 8
OUT_SCALE = 1.0 / 16
# Triton's CPU interpreter has no libdevice; it never contracts a multiply into an add either.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
def rotated_in(x, vec, scale, R: tl.constexpr, ROUNDED_MUL: tl.constexpr):
    """The input side on float32 rows [R, 128]: had(x * vec) * scale. The product is rounded on its own, as the
    twin's is: the compiler may otherwise fuse it into the first butterfly's add (an fma: one rounding fewer, other
    bits); mul_rn is never contracted (ROUNDED_MUL off: the interpreter, which never contracts)."""
    if ROUNDED_MUL:
        x = libdevice.mul_rn(x, vec)
    else:
        x = x * vec
    return had128(x, R) * scale


@triton.jit
def rotated_out(acc, vec, scale, R: tl.constexpr):
    """The output side on float32 rows [R, 128]: had(acc) * (vec * scale)."""
    return had128(acc, R) * (vec * scale)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["R", "rows_per_vec"], do_not_specialize_on_alignment=["src_rows_ptr", "vec_rows_ptr"])
def _rotate_kernel(src_ptr, vec_ptr, vec2_ptr, out_ptr, src_rows_ptr, vec_rows_ptr, R, C, V, rows_per_vec, ssr, svr,
                   sor, scale, PRE: tl.constexpr, SRC_ROWS: tl.constexpr, VEC_ROWS: tl.constexpr,
                   BLOCK_R: tl.constexpr, ROUNDED_MUL: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [R, C] in 128-blocks. Program axis 2 picks the vector stack (vec, or vec2 for a second output of the
    same rows written R rows further on: the MoE's gate and up rotate one gathered input in one launch)."""
    wait_for_inputs(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    second = tl.program_id(2)
    in_range = r < R
    srow = tl.load(src_rows_ptr + r, mask=in_range, other=-1) if SRC_ROWS else r
    vrow = tl.load(vec_rows_ptr + r, mask=in_range, other=V) if VEC_ROWS else r // rows_per_vec
    live = in_range & (srow >= 0) & (vrow < V)
    srow = tl.where(live, srow, 0).to(tl.int64)
    vrow = tl.where(live, vrow, 0).to(tl.int64)
    m = live[:, None]
    x = tl.load(src_ptr + srow[:, None] * ssr + c[None, :], mask=m, other=0.0).to(tl.float32)
    if second == 0:
        vec = tl.load(vec_ptr + vrow[:, None] * svr + c[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        vec = tl.load(vec2_ptr + vrow[:, None] * svr + c[None, :], mask=m, other=0.0).to(tl.float32)
    if PRE:
        y = rotated_in(x, vec, scale, BLOCK_R, ROUNDED_MUL)
    else:
        y = rotated_out(x, vec, scale, BLOCK_R)
    out_row = (second * R + r).to(tl.int64)  # dead rows (empty MoE slots) become 0
    tl.store(out_ptr + out_row[:, None] * sor + c[None, :], tl.where(m, y, 0.0).to(out_ptr.dtype.element_ty),
             mask=in_range[:, None])


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["R"], do_not_specialize_on_alignment=["vec_rows_ptr"])
def _rotate_out_swiglu_kernel(g_ptr, u_ptr, gvec_ptr, uvec_ptr, nvec_ptr, vec_rows_ptr, h_ptr, act_ptr, R, C, V,
                              limit, out_scale, in_scale, NEXT: tl.constexpr, BLOCK_R: tl.constexpr,
                              ROUNDED_MUL: tl.constexpr, PDL: tl.constexpr = False):
    """h = SwiGLU(rotate_out(g), rotate_out(u)) per row: each projection rotated, scaled and rounded to the
    activation dtype exactly as `rotate_out` does, then `clamped_swiglu` (kernels/gpu/swiglu.py). NEXT:
    h then goes through `rotate_in` with the next product's suh (the same 128-column block, so the same program)
    and that operand is stored instead of h."""
    wait_for_inputs(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    in_range = r < R
    vrow = tl.load(vec_rows_ptr + r, mask=in_range, other=V)
    live = in_range & (vrow < V)
    vrow = tl.where(live, vrow, 0).to(tl.int64)
    m = live[:, None]
    rows = r.to(tl.int64)[:, None] * C + c[None, :]
    vecs = vrow[:, None] * C + c[None, :]
    act = act_ptr.dtype.element_ty  # the activation dtype (h's, or the rounding before the next rotation)
    g = rotated_out(tl.load(g_ptr + rows, mask=m, other=0.0),
                    tl.load(gvec_ptr + vecs, mask=m, other=0.0).to(tl.float32), out_scale, BLOCK_R)
    u = rotated_out(tl.load(u_ptr + rows, mask=m, other=0.0),
                    tl.load(uvec_ptr + vecs, mask=m, other=0.0).to(tl.float32), out_scale, BLOCK_R)
    h = clamped_swiglu(tl.where(m, g, 0.0).to(act).to(tl.float32), tl.where(m, u, 0.0).to(act).to(tl.float32),
                       limit, act)
    if NEXT:  # rotate_in's arithmetic on the rounded h
        nvec = tl.load(nvec_ptr + vecs, mask=m, other=0.0).to(tl.float32)
        y = rotated_in(h.to(tl.float32), nvec, in_scale, BLOCK_R, ROUNDED_MUL)
        tl.store(h_ptr + rows, tl.where(m, y, 0.0).to(h_ptr.dtype.element_ty), mask=in_range[:, None])
    else:
        tl.store(h_ptr + rows, h, mask=in_range[:, None])


def _rows(src: torch.Tensor, vec: torch.Tensor, out: torch.Tensor, pre: bool, scale: float,
          src_rows: torch.Tensor | None, vec_rows: torch.Tensor | None, rows_per_vec: int,
          vec2: torch.Tensor | None = None) -> torch.Tensor:
    r = out.shape[0] // (2 if vec2 is not None else 1)
    c = src.shape[1]
    if c % HAD or vec.shape[-1] != c or src.stride(1) != 1 or out.stride(1) != 1 or vec.stride(-1) != 1:
        raise ValueError(f"rotate: rows of {c} (a multiple of {HAD}, unit stride) with vectors {list(vec.shape)}")
    vec2d = vec.reshape(-1, c)
    other = vec2d if vec2 is None else vec2.reshape(-1, c)
    if other.shape != vec2d.shape or other.stride() != vec2d.stride():
        raise ValueError("rotate: the two vector stacks must have one shape and layout")
    dummy = torch.empty(1, dtype=torch.int32, device=src.device)
    if r:
        _rotate_kernel[(triton.cdiv(r, _BLOCK_R), c // HAD, 1 if vec2 is None else 2)](
            src, vec2d, other, out, dummy if src_rows is None else src_rows, dummy if vec_rows is None else vec_rows,
            r, c, vec2d.shape[0], max(rows_per_vec, 1), src.stride(0), vec2d.stride(0), out.stride(0), float(scale),
            PRE=pre, SRC_ROWS=src_rows is not None, VEC_ROWS=vec_rows is not None, BLOCK_R=_BLOCK_R,
            ROUNDED_MUL=not INTERPRETED, **pdl.options())
    return out


def operand_dtype(act: torch.dtype) -> torch.dtype:
    """The dtype EXL3's GEMM multiplies in for activations of dtype `act` (see the module note)."""
    return torch.float32 if act == torch.float32 else torch.float16


def rotate_in(x: torch.Tensor, suh: torch.Tensor, *, rows: int | None = None, src_rows: torch.Tensor | None = None,
              vec_rows: torch.Tensor | None = None, rows_per_vec: int | None = None,
              suh2: torch.Tensor | None = None) -> torch.Tensor:
    """had(x[row] * suh[vector of row]) / 8 per row -> [rows, C] in `operand_dtype(x.dtype)`.

    x [R, C]; suh [V, C] (or [C]). Rows are x's own unless `src_rows` gathers them; the vector of output row r is
    `vec_rows[r]` or r // rows_per_vec (default: all rows share suh[0]). With `suh2` (a second stack of suh's
    shape), the same rows are rotated with it too, in the same launch: -> [2 * rows, C], suh2's rows second."""
    n = rows if rows is not None else (src_rows.shape[0] if src_rows is not None else x.shape[0])
    out = torch.empty(n * (1 if suh2 is None else 2), x.shape[1], dtype=operand_dtype(x.dtype), device=x.device)
    return _rows(x, suh, out, True, IN_SCALE, src_rows, vec_rows, rows_per_vec or max(n, 1), suh2)


def rotate_out(acc: torch.Tensor, svh: torch.Tensor, out_dtype: torch.dtype, *, vec_rows: torch.Tensor | None = None,
               rows_per_vec: int | None = None) -> torch.Tensor:
    """had(acc[row]) * svh[vector of row] / 16 per row of a float32 [R, C] accumulator -> [R, C] in out_dtype."""
    out = torch.empty(acc.shape[0], acc.shape[1], dtype=out_dtype, device=acc.device)
    return _rows(acc, svh, out, False, OUT_SCALE, None, vec_rows, rows_per_vec or max(acc.shape[0], 1))


def rotate_out_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_svh: torch.Tensor, up_svh: torch.Tensor,
                      vec_rows: torch.Tensor, limit: float, out_dtype: torch.dtype,
                      next_suh: torch.Tensor | None = None) -> torch.Tensor:
    """GLM's clamped SwiGLU of two rotated-out float32 accumulators [R, C] (gate's and up's, row r's vectors
    `vec_rows[r]` of each stack) -> h [R, C] in out_dtype: the bits of `rotate_out` on each, then SwiGLU, in one
    launch; rows whose vector index is past the stacks (empty MoE slots) give 0. With `next_suh` (the next
    product's input vectors, same stack rows): `rotate_in(h, next_suh, vec_rows=vec_rows)` instead, in the same
    launch, in `operand_dtype(out_dtype)`."""
    r, c = gate.shape
    if up.shape != gate.shape or c % HAD or gate_svh.shape != up_svh.shape or gate_svh.shape[-1] != c or (
            next_suh is not None and next_suh.shape != gate_svh.shape):
        raise ValueError(f"rotate_out_swiglu: accumulators {list(gate.shape)} / {list(up.shape)}, vectors "
                         f"{list(gate_svh.shape)} / {list(up_svh.shape)}")
    nxt = next_suh is not None
    h = torch.empty(r, c, dtype=operand_dtype(out_dtype) if nxt else out_dtype, device=gate.device)
    if r:
        _rotate_out_swiglu_kernel[(triton.cdiv(r, _BLOCK_R), c // HAD)](
            gate.contiguous(), up.contiguous(), gate_svh.contiguous(), up_svh.contiguous(),
            next_suh.contiguous() if nxt else gate_svh, vec_rows, h, torch.empty(1, dtype=out_dtype, device=h.device),
            r, c, gate_svh.shape[0], float(limit), OUT_SCALE, IN_SCALE, NEXT=nxt, BLOCK_R=_BLOCK_R,
            ROUNDED_MUL=not INTERPRETED, **pdl.options())
    return h
