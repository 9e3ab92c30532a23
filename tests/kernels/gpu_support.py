"""What the Triton-kernel tests need: skip without Triton, and the dtype the interpreter can multiply.

On a machine without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET),
whose `tl.dot` mishandles bfloat16 (numpy has no bf16): those tests use float16 there and bfloat16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# Tolerance of a half-precision kernel against an fp32 twin: bf16 keeps 8 mantissa bits, fp16 11.
HALF_TOL = dict(rtol=4e-2, atol=0.1) if HALF == torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)


def randn(*shape: int, dtype: torch.dtype = HALF, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)
