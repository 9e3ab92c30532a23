"""The dense SwiGLU kernel (kernels/gpu/swiglu.py) against the torch twin kernels/moe.swiglu, on the strided halves
of a gate|up projection output, and its row invariance."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import HALF, HALF_TOL, randn

from kernels import moe as ref  # noqa: E402
from kernels.gpu import swiglu  # noqa: E402

S, T, I, LIMIT = 3, 5, 200, 3.0  # I not a power of two: the last column block is partly masked
SCALE = 4.0  # a good share of gate and up values lie past the limit, so both clamps are exercised


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = x.split(I, dim=-1)
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_matches_twin_on_projection_halves(dtype: torch.dtype) -> None:
    gate, up = halves(randn(S, T, 2 * I, dtype=dtype, seed=1, scale=SCALE))
    assert not gate.is_contiguous()  # the kernel reads the views as the MLP hands them over
    out = swiglu.swiglu(gate, up, LIMIT)
    assert out.shape == (S, T, I) and out.is_contiguous() and out.dtype == dtype
    want = ref.swiglu(gate.cpu(), up.cpu(), LIMIT)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.cpu(), want, **tol)


def test_any_leading_strides() -> None:
    """Shards not outermost in memory ([T, S, 2I] seen as [S, T, 2I]) give the bits of the contiguous layout."""
    x = randn(T, S, 2 * I, seed=2, scale=SCALE).transpose(0, 1)
    strided = swiglu.swiglu(*halves(x), LIMIT)
    assert torch.equal(strided, swiglu.swiglu(*halves(x.contiguous()), LIMIT))


def test_row_alone_equals_row_in_company() -> None:
    x = randn(S, T, 2 * I, seed=3, scale=SCALE)
    crowd = swiglu.swiglu(*halves(x), LIMIT)
    for row in range(T):
        assert torch.equal(swiglu.swiglu(*halves(x[:, row : row + 1]), LIMIT)[:, 0], crowd[:, row])


def test_no_rows() -> None:
    assert swiglu.swiglu(*halves(randn(S, 0, 2 * I, seed=4)), LIMIT).shape == (S, 0, I)
