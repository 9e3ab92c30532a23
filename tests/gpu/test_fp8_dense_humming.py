"""The wide fp8 linears on humming-kernels' dense GEMM (kernels/gpu/fp8_dense.py) on the GPU, at KDA q|k|v's shape
(24,576 x 4,096 over four virtual shards of 6,144):

- against the torch twin (the dequantized weight in fp32), normwise;
- a row alone = the same row among 2 .. 64 rows, bit for bit;
- every shard's columns the same bits launched with 1, 2 or 4 local shards (TP 4, 2, 1);
- prompt rows = our GEMM's prompt schedule on the stored operand;
- a CUDA graph's replay = the eager call.
Run with `-s` for the figures.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
SHARDS, N, K = 4, 6144, 4096
COMPANY = (2, 3, 8, 9, 16, 17, 33, 64)


def _needs_humming() -> None:
    from kernels.gpu import int_moe
    if not int_moe.available():
        pytest.skip("humming-kernels is not installed (pip install -e '.[gpu]')")


@pytest.fixture(scope="module")
def weights():
    """(stored WeightArgs [S, N, K], its dequantized fp32 [S, N, K], the prepared operand)."""
    _needs_humming()
    from kernels.gpu import fp8_dense, wtiles
    from kernels.quant import fp8
    torch.manual_seed(0)
    shards = [fp8.quantize_blocks(torch.randn(N, K, device=DEV) * 0.02, (128, 128)) for _ in range(SHARDS)]
    stacked = {key: torch.stack([s[key] for s in shards]) for key in shards[0]}
    w = wtiles.quantized("fp8", stacked, {"block": [128, 128]})
    dense = stacked["weight"].float() * stacked["weight_scale_inv"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    return w, dense, fp8_dense.prepare(w, torch.bfloat16)


def _x(m: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(1)
    return torch.randn(m, K, device=DEV, dtype=torch.bfloat16, generator=g)


def _decode(x: torch.Tensor, w) -> torch.Tensor:
    from kernels.gpu import fp8_dense
    xs = x.unsqueeze(0).expand(w.data.shape[0], -1, -1)
    return fp8_dense.bmm(xs, w, x.shape[0])


def test_against_the_twin(weights):
    _, dense, prep = weights
    x = _x(64)
    got = _decode(x, prep).float()
    want = torch.einsum("mk,snk->smn", x.float(), dense)
    err = ((got - want).norm() / want.norm()).item()
    print(f"\nfp8 dense on humming vs the fp32 twin: normwise {err:.2e}")
    assert err < 5e-3


def test_row_alone_equals_row_among_others(weights):
    prep = weights[2]
    x = _x(max(COMPANY))
    full = _decode(x, prep)
    differ = [m for m in (1, *COMPANY) if not torch.equal(_decode(x[:m].contiguous(), prep), full[:, :m])]
    print(f"\nfp8 dense on humming: rows differing alone vs among others: {differ}")
    assert not differ


def test_shard_bits_whatever_the_local_shards(weights):
    """TP 1 launches the four shards side by side, TP 2 two, TP 4 one: each shard's columns the same bits."""
    from kernels.gpu import fp8_dense, wtiles
    w, _, prep = weights
    x = _x(8)
    full = _decode(x, prep)
    for per in (1, 2):
        for first in range(0, SHARDS, per):
            part = wtiles.WeightArgs(w.fmt, w.data[first:first + per], w.scale[first:first + per], w.block_n,
                                     w.block_k)
            got = _decode(x, fp8_dense.prepare(part, torch.bfloat16))
            assert torch.equal(got, full[first:first + per]), (per, first)


def test_prompt_rows_take_our_prompt_schedule(weights):
    from kernels.gpu import fp8_dense, gemm
    w, _, prep = weights
    x = _x(40).unsqueeze(0).expand(SHARDS, -1, -1)
    got = fp8_dense.bmm(x, prep, 8)
    assert torch.equal(got[:, 8:], gemm.bmm(x[:, 8:], w, 0))
    assert torch.equal(got[:, :8], fp8_dense.bmm(x[:, :8], prep, 8))


def test_graph_replay_equals_eager(weights):
    prep = weights[2]
    x = _x(8)
    eager = _decode(x, prep)
    static = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _decode(static, prep)  # warm on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = _decode(static, prep)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
