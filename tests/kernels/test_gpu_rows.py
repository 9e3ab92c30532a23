"""The one-launch cache-row write (kernels/gpu/rows.py) against the torch ops it replaced (each row's block and
offset from the block tables, then RowStore.write's index_put and, for fp8, kernels/kv_quant.py's quantization):
the same bytes, graph padding rows included, and a row's bytes whatever rows are written with it."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, randn

from kernels.gpu import rows as gpu_rows  # noqa: E402
from kernels.kv_quant import FP8, FP8_MAX  # noqa: E402
from model.row_store import RowStore  # noqa: E402

BS, BLOCKS, SCRATCH = 8, 7, 6
TABLES = [[3, 0, 5], [1, 4, 2]]  # two sequences' (shuffled) blocks; block 6 is the scratch block
# (sequence, position) of every real row: decode rows, then a prompt chunk across a block boundary
REAL = [(1, 17), (0, 9), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (0, 8)]
PAD = 3  # graph padding rows: position 0 of their own table row, which is all scratch (model/cuda_graphs.py)
STORES = {"auto": None, "fp8": FP8}


def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables, positions, row_seq) as GpuRows holds them, padding rows last."""
    tables = torch.tensor(TABLES + [[SCRATCH] * 3] * PAD, dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([p for _, p in REAL] + [0] * PAD, dtype=torch.int32, device=DEVICE)
    seq = torch.tensor([s for s, _ in REAL] + list(range(len(TABLES), len(TABLES) + PAD)), dtype=torch.int32,
                       device=DEVICE)
    return tables, pos, seq


def store(width: int, dtype: torch.dtype, stored: torch.dtype | None) -> RowStore:
    s = RowStore(BLOCKS, BS, width, dtype=dtype, stored=stored, device=DEVICE)
    s.data.view(torch.uint8).fill_(0x11)  # not zeros: a row the kernel misses would show
    return s


def torch_write(s: RowStore, tables: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, values: torch.Tensor
                ) -> None:
    """The torch ops the launch replaced: each row's block and offset from the tables, then RowStore.write."""
    p = pos.long()
    s.write(tables[seq.long(), p // BS].long(), p % BS, values)


def same(a: RowStore, b: RowStore) -> bool:
    scales = a.scale is None or torch.equal(a.scale.view(torch.int32), b.scale.view(torch.int32))
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and scales


def values(width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different sizes, a zero row, signed zeros, an outlier (the rest of its row in e4m3's
    subnormals); the padding rows all alike, as a graph's are (token 0 at position 0)."""
    n = len(REAL)
    v = randn(n + PAD, width, dtype=torch.float32, seed=seed)
    v[:n] *= torch.logspace(-3, 3, n, device=DEVICE).unsqueeze(1)
    v[2] = 0.0
    v[3, ::3] = -0.0
    v[4, 5] = 3e4
    v[n:] = v[n]
    return v.to(dtype)


@pytest.mark.parametrize("stored", STORES.values(), ids=STORES.keys())
@pytest.mark.parametrize("split", [None, 16], ids=["one_source", "two_sources"])
def test_write_equals_torch_path(stored: torch.dtype | None, split: int | None) -> None:
    width = 48
    tables, pos, seq = rows()
    v = values(width, HALF, seed=1)
    want, got = store(width, HALF, stored), store(width, HALF, stored)
    torch_write(want, tables, pos, seq, v)
    if split is None:
        gpu_rows.write(got.data, got.scale, tables, pos, seq, v)
    else:  # dsa_select's key | gate columns, the second a strided view, as the projection's split gives it
        wide = torch.cat([v[:, split:], v[:, :split]], dim=1)
        gpu_rows.write(got.data, got.scale, tables, pos, seq, v[:, :split].contiguous(), wide[:, : width - split])
    assert same(got, want)
    assert not bool((want.data[SCRATCH, 0].view(torch.uint8) == 0x11).all())  # padding rows write the scratch block


def test_fp8_ties_round_to_even() -> None:
    """A row whose scale is exactly 1 (its max is 448), holding every midpoint between neighbouring e4m3 values
    (normal and subnormal, both signs) and the values either side of them, and rows of those times a few factors
    (quotients a hair off the midpoints, where only an exact division rounds as torch does): the torch path's
    bits."""
    codes = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, every finite non-negative value
    mid = (codes[1:] + codes[:-1]) / 2
    near = torch.cat([mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])
    row = torch.cat([torch.tensor([FP8_MAX, -0.0]), near, -near])
    width = row.numel()
    tables, pos, seq = rows()
    factors = torch.tensor([1.0, 3.0, 0.7, 1e-3, 1.0 + 2**-20])
    pos, seq = pos[: len(factors)], seq[: len(factors)]
    v = (row * factors.unsqueeze(1)).to(DEVICE)
    want, got = store(width, torch.float32, FP8), store(width, torch.float32, FP8)
    torch_write(want, tables, pos, seq, v)
    gpu_rows.write(got.data, got.scale, tables, pos, seq, v)
    assert float(want.scale[TABLES[1][2], 17 % BS]) == 1.0
    assert same(got, want)


@pytest.mark.parametrize("stored", STORES.values(), ids=STORES.keys())
def test_row_alone_equals_row_among_others(stored: torch.dtype | None) -> None:
    width = 40
    tables, pos, seq = rows()
    v = values(width, HALF, seed=2)
    together, alone = store(width, HALF, stored), store(width, HALF, stored)
    gpu_rows.write(together.data, together.scale, tables, pos, seq, v)
    for i in range(len(REAL) + PAD):
        gpu_rows.write(alone.data, alone.scale, tables, pos[i : i + 1], seq[i : i + 1], v[i : i + 1])
    assert same(alone, together)
