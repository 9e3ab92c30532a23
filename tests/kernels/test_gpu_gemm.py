"""The fixed-schedule GEMM (kernels/gpu/gemm.py) against torch, and its row invariance (DESIGN §5.1)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, randn

from kernels.gpu import gemm  # noqa: E402  (after the importorskip in gpu_support)

# decode_rows values that make every row decode-class, or every row a prompt row
CLASSES = {"decode": 1 << 30, "prefill": 0}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
@pytest.mark.parametrize("m,n,k", [(1, 64, 512), (37, 200, 1024), (130, 96, 384)])
def test_matches_torch(rows: int, m: int, n: int, k: int) -> None:
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    out = gemm.matmul(x, w, rows, out_dtype=torch.float32)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double(), reference(x, w), rtol=1e-3, atol=1e-3 * k ** 0.5)


def test_decode_schedule_splits_k_and_sums_in_order() -> None:
    tile = gemm.schedule(64, 4096, gemm.RowClass.DECODE)
    assert tile.split_k > 1  # one N tile: the decode schedule must spread K over programs
    x, w = randn(3, 4096, seed=3), randn(64, 4096, seed=4)
    out = gemm.matmul(x, w, CLASSES["decode"], out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(x, w), rtol=1e-3, atol=0.1)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_row_alone_equals_row_in_company(rows: int) -> None:
    k, n = 1024, 160
    w = randn(n, k, seed=5)
    crowd = randn(150, k, seed=6)
    alone = gemm.matmul(crowd[77:78], w, rows, out_dtype=torch.float32)
    for m in (2, 17, 78, 150):
        together = gemm.matmul(crowd[:m] if m > 77 else torch.cat([crowd[77:78], crowd[:m - 1]]), w, rows,
                               out_dtype=torch.float32)
        row = together[77] if m > 77 else together[0]
        assert torch.equal(row, alone[0]), f"row changed beside {m - 1} others"


def test_split_rows_use_each_class_schedule() -> None:
    x, w = randn(40, 512, seed=7), randn(96, 512, seed=8)
    mixed = gemm.matmul(x, w, 9, out_dtype=torch.float32)
    assert torch.equal(mixed[:9], gemm.matmul(x[:9], w, CLASSES["decode"], out_dtype=torch.float32))
    assert torch.equal(mixed[9:], gemm.matmul(x[9:], w, CLASSES["prefill"], out_dtype=torch.float32))
    mixed3 = gemm.bmm(torch.stack([x, x, x]), torch.stack([w, w, w]), 9, out_dtype=torch.float32)
    assert all(torch.equal(mixed3[i], mixed) for i in range(3))


def test_batched_strided_weights() -> None:
    """Per-head products with the weight stored K x N (MLA's absorbed W_uk): strides, not copies."""
    x = randn(4, 10, 64, seed=9)  # [heads, rows, K]
    w_kn = randn(4, 64, 48, seed=10)  # [heads, K, N]
    out = gemm.bmm(x, w_kn.transpose(1, 2), 4, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), x.double() @ w_kn.double(), rtol=1e-3, atol=1e-2)


def test_output_dtype_follows_input_by_default() -> None:
    out = gemm.matmul(randn(2, 256, seed=11), randn(32, 256, seed=12), 0)
    assert out.dtype == HALF and out.device.type == DEVICE
