"""Cache rows written from the device's row facts in one launch (torch twin: RowStore.write at the addresses
model/cache.py computes, with kernels/kv_quant.py's quantization for an fp8 store).

In torch a write was about seven launches (the rows' positions widened, `// block_size`, a block-table gather,
`% block_size`, the index_put) and, for an fp8 store, the quantization's dozen more. Here one program per row reads
its position and sequence, looks its block up in the table and stores the row: the same bits, as every step is a
copy or exact (a max, a multiply and a division each rounded once, a rounding to e4m3). Graph padding rows (position
0 of a table row filled with the scratch block, model/cuda_graphs.py) write the scratch block, as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import pdl
from kernels.gpu.mla import _row_address
from kernels.gpu.pdl import wait_for_inputs
from kernels.kv_quant import FP8_MAX, INV_FP8_MAX

_MAX = tl.constexpr(FP8_MAX)
_INV_MAX = tl.constexpr(INV_FP8_MAX)  # an fp32 number already, so the kernel's fp32 constant is exactly it


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32 (exactly representable in e4m3,
    so the cast that follows is exact). Spelt out because the Triton interpreter's fp32 -> fp8 cast truncates
    subnormals and rounds ties up; the GPU's cast (round to nearest even) gives these bits too."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # Adding 2^(e + 20) (e: the exponent of |v|, at least e4m3's smallest normal one, -6) leaves fp32 steps of
    # 2^(e - 3), e4m3's step at that exponent: the sum rounds |v| to it (to even on a tie), subtracting it is exact.
    magic = ((tl.maximum(mag >> 23, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (mag.to(tl.float32, bitcast=True) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)  # v's sign, -0 too


@triton.jit(do_not_specialize=["s_bt"], do_not_specialize_on_alignment=["pos_ptr", "seq_ptr"])
def _write_kernel(a_ptr, s_a, b_ptr, s_b, data_ptr, scale_ptr, bt_ptr, s_bt, pos_ptr, seq_ptr,
                  WA: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Row r = columns [0, WA) of a's row r, then [WA, W) from b's, stored at its position's cache row."""
    wait_for_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = _row_address(bt_ptr, s_bt, tl.load(seq_ptr + r), tl.load(pos_ptr + r), BS)
    c = tl.arange(0, BLOCK)
    x = tl.load(a_ptr + r * s_a + c, mask=c < WA, other=0.0)
    if W > WA:  # a select, not an add: -0.0 + 0.0 would lose the zero's sign
        x = tl.where(c < WA, x, tl.load(b_ptr + r * s_b + c - WA, mask=(c >= WA) & (c < W), other=0.0))
    if FP8:  # kernels/kv_quant.quantize_rows, step for step
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, amax * _INV_MAX, 1.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_MAX), _MAX)  # div_rn: IEEE, as torch divides
        tl.store(data_ptr + row * W + c, _round_e4m3(v).to(data_ptr.dtype.element_ty), mask=c < W)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(data_ptr + row * W + c, x.to(data_ptr.dtype.element_ty), mask=c < W)


def write(data: torch.Tensor, scale: torch.Tensor | None, block_tables: torch.Tensor, positions: torch.Tensor,
          row_seq: torch.Tensor, values: torch.Tensor, tail: torch.Tensor | None = None) -> None:
    """Store row i of values (then of tail, when given: its columns follow, so no concatenated copy is made) at
    position positions[i] of sequence row_seq[i]: data [blocks, BS, W] (+ fp8 scale [blocks, BS], quantized as
    kernels/kv_quant.py does); values [T, WA], tail [T, W - WA] (unit column stride); positions, row_seq int32 [T]."""
    t, width = positions.numel(), data.shape[-1]
    if t == 0:
        return
    wa = values.shape[-1]
    assert values.shape[0] == t and values.stride(-1) == 1 and wa + (0 if tail is None else tail.shape[-1]) == width
    b = values if tail is None else tail
    assert b.stride(-1) == 1
    _write_kernel[(t,)](values, values.stride(0), b, b.stride(0), data, scale if scale is not None else data,
                        block_tables, block_tables.stride(0), positions, row_seq, WA=wa, W=width,
                        BS=data.shape[1], BLOCK=triton.next_power_of_2(width), FP8=scale is not None,
                        num_warps=4, **pdl.options())
