"""The fused forward's cache-row writes (one launch, kernels/gpu/rows.py) store what the reference forward's write
stores, bit for bit, in the compute dtype and in fp8 — decode rows, a verify window and a prompt chunk across a
block boundary, with shuffled block tables — and a CUDA graph's padding rows write the scratch block as the torch
ops did."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU tests/kernels/test_gpu_rows.py checks the launch against the torch ops")

import ops  # noqa: E402
from kernels.gpu.seqs import DecodeSeqs  # noqa: E402
from kernels.kv_quant import FP8  # noqa: E402
from model.batch import Batch  # noqa: E402
from model.cache import PagedCache  # noqa: E402
from model.row_store import RowStore  # noqa: E402
from ops.fused import FusedForward  # noqa: E402
from ops.fused_rows import GpuRows  # noqa: E402
from tests.model.reference import BLOCK, our_model  # noqa: E402

STORES = {"auto": None, "fp8": FP8}
TABLES = [[2, 5, 0], [4, 1, 3], [6, 7, 8]]  # shuffled, so a wrong address shows


def cache_of(ckpt, kv_dtype: torch.dtype | None) -> PagedCache:
    cache = our_model(ckpt).new_cache(num_blocks=9, block_size=BLOCK, num_slots=3, kv_dtype=kv_dtype)
    for store in [*cache.latent.values(), *cache.index_keys.values()]:
        store.data.view(torch.uint8).fill_(0x11)  # not zeros: a row written nowhere or twice would show
    return cache


def stores(cache: PagedCache) -> list[torch.Tensor]:
    """Every store's bytes (data, then the fp8 scales)."""
    out = []
    for store in [*cache.latent.values(), *cache.index_keys.values()]:
        out.append(store.data.view(torch.uint8))
        if store.scale is not None:
            out.append(store.scale.view(torch.int32))
    return out


def write_all(write: Callable[[RowStore, torch.Tensor], None], cache: PagedCache, rows: int,
              alike_from: int | None = None) -> None:
    """Random rows (one all zero, some signed zeros; rows from `alike_from` on all alike) into every store."""
    for i, store in enumerate([*cache.latent.values(), *cache.index_keys.values()]):
        g = torch.Generator().manual_seed(i)
        v = torch.randn(rows, store.width, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)
        v[0] = 0.0
        v[1, ::4] = -0.0
        if alike_from is not None:
            v[alike_from:] = v[alike_from]
        write(store, v.to(store.dtype))


@pytest.mark.parametrize("kv_dtype", STORES.values(), ids=STORES.keys())
def test_fused_writes_equal_reference_writes(tiny_default, kv_dtype: torch.dtype | None) -> None:
    # a decode row, a verify window, then a prompt chunk crossing a block boundary (decode-class sequences first)
    batch = Batch(token_ids=torch.zeros(1 + 3 + 6, dtype=torch.long), starts=[30, 17, 12], lengths=[1, 3, 6],
                  block_tables=torch.tensor(TABLES), slots=[0, 1, 2], logit_rows=torch.arange(10),
                  verify=[False, True, False], prompt=[False, False, True])
    want, got = cache_of(tiny_default, kv_dtype), cache_of(tiny_default, kv_dtype)
    write_all(ops.begin(batch, want, fused=False).write_rows, want, 10)
    write_all(ops.begin(batch, got, fused=True).write_rows, got, 10)
    for w, g in zip(stores(want), stores(got), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kv_dtype", STORES.values(), ids=STORES.keys())
def test_graph_padding_rows_write_the_scratch_block(tiny_default, kv_dtype: torch.dtype | None) -> None:
    """GpuRows as model/cuda_graphs.py fills them for 2 real decode rows in a bucket of 4: the padding rows sit at
    position 0 of table rows filled with the scratch block. Their rows are alike (a graph's padding rows all run
    token 0 at position 0), so the scratch block's bytes are defined whichever padding row lands last."""
    want, got = cache_of(tiny_default, kv_dtype), cache_of(tiny_default, kv_dtype)
    scratch = got.scratch_block
    tables = torch.tensor(TABLES[:2] + [[scratch] * 3] * 2, dtype=torch.int32)
    pos = torch.tensor([30, 17, 0, 0], dtype=torch.int32)
    seq = torch.arange(4, dtype=torch.int32)
    kda = DecodeSeqs(row0=seq, length=torch.ones_like(seq), slot=seq, fresh=seq, pending=seq)
    rows = GpuRows(n_rows=4, decode_rows=4, positions=pos, row_seq=seq, tables=tables, n_real=torch.tensor([2]),
                   kda=kda, verify=[], verify_rows=[], prompt=None, max_pools=0)
    batch = Batch(token_ids=torch.zeros(4, dtype=torch.long), starts=[0] * 4, lengths=[1] * 4, block_tables=tables,
                  slots=[0] * 4, logit_rows=torch.arange(4), prompt=[False] * 4)

    def torch_write(store: RowStore, values: torch.Tensor) -> None:  # the torch ops the launch replaced
        p = pos.long()
        store.write(tables[seq.long(), p // BLOCK].long(), p % BLOCK, values)

    write_all(torch_write, want, 4, alike_from=2)
    write_all(FusedForward(batch, got, rows).write_rows, got, 4, alike_from=2)
    for w, g in zip(stores(want), stores(got), strict=True):
        assert torch.equal(g, w)
    assert not bool((got.latent[next(iter(got.latent))].data[scratch, 0].view(torch.uint8) == 0x11).all())
