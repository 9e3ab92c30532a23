"""`tl.dot` in Triton's CPU interpreter, made row-invariant the way a GPU's tensor-core product is.

The interpreter computes `tl.dot` with `np.matmul`, i.e. the machine's BLAS. Some BLAS builds give a row of the
product different bits depending on where the row sits in the operand (OpenBLAS 0.3.30 on AMD Zen 3, as numpy 2.3
ships it, differs for every row of a 128 x 64 @ 64 x 256 tile once the rows move down by one). On a GPU a tile's
row is computed from that row alone, so the exactness tests (a row alone = the same row among others, whole =
chunked, TP=1 = TP=2) hold there and would fail here for a reason that is not the kernels'. numpy's einsum sums
each output element over K in one fixed order, wherever its row is, at the same speed for tiles of these sizes.
This is a stand-in for the GPU's arithmetic, installed only when the interpreter runs (no CUDA)."""

from __future__ import annotations

import numpy as np


def install() -> None:
    """Replace the interpreter's dot (nothing to do without Triton: the kernel tests skip themselves)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
                (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # fp8 operands, as the interpreter does
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        product = np.einsum("...ij,...jk->...ik", a_data, b_data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
