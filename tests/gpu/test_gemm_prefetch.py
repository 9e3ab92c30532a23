"""The GEMM's L2 prefetch before its programmatic-launch wait (kernels/gpu/gemm.py, kernels/gpu/pdl.py) on a GPU:
decode products of the release's shapes, fp8 with 128 x 128 block scales and bf16, at 1, 8 and 64 rows, give the
same bits with no prefetch, the default budget and every line of each program's K span prefetched; and a chain
of two products (the second's prefetch running while the first still computes its input), eager and replayed
from a CUDA graph with a new input, equals the chain without prefetch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODE = 1 << 30  # every row decode-class
# (N, K): KDA's q|k|v, o_proj, MLA's q_a|kv_a
SHAPES = [(24576, 4096), (4096, 8192), (2048, 4096)]


@pytest.fixture(autouse=True)
def _needs_pdl():
    from kernels.gpu import pdl
    if not pdl.enabled():
        pytest.skip("prefetching runs with programmatic launch only (sm_90+, TWINSPARK_PDL unset)")


def _weight(n: int, k: int, fmt: str, seed: int):
    from kernels.gpu import gemm, wtiles
    from kernels.quant import fp8
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    if fmt == "bf16":
        return gemm.dense(w.to(torch.bfloat16))
    return wtiles.quantized("fp8", fp8.quantize_blocks(w), {"block": fp8.DEFAULT_BLOCK})


BUDGETS = {"off": 0, "default": None, "whole span": 1 << 40}


def _budget(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from kernels.gpu import pdl
    value = pdl.PREFETCH_MIB << 20 if BUDGETS[name] is None else BUDGETS[name]
    monkeypatch.setattr(pdl, "_prefetch_budget", lambda: value)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_prefetch_changes_no_bit(monkeypatch: pytest.MonkeyPatch, fmt: str, n: int, k: int) -> None:
    from kernels.gpu import gemm
    w = _weight(n, k, fmt, seed=n + k)
    x = (torch.randn(64, k, device="cuda") * 0.5).to(torch.bfloat16)
    tile = gemm.schedule(n, k, gemm.RowClass.DECODE)
    per_split = -(-k // tile.split_k)
    got = {}
    for name in BUDGETS:
        _budget(monkeypatch, name)
        lines, _ = gemm.prefetch_lines(w, tile, per_split, (n // tile.block_n) * tile.split_k)
        assert (lines > 0) == (name != "off"), (name, lines)
        got[name] = [gemm.matmul(x[:rows], w, DECODE, torch.float32) for rows in (1, 8, 64)]
    for name in ("default", "whole span"):
        for rows, a, b in zip((1, 8, 64), got["off"], got[name]):
            assert torch.equal(a, b), f"{fmt} {n}x{k}, {rows} rows, prefetch {name}"


def test_a_chain_replayed_from_a_graph_equals_it_without_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.gpu import gemm
    w1, w2 = _weight(4096, 8192, "fp8", seed=1), _weight(24576, 4096, "fp8", seed=2)
    x = torch.empty(8, 8192, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        return gemm.matmul(gemm.matmul(x, w1, DECODE), w2, DECODE, torch.float32)

    inputs = [(torch.randn(8, 8192, device="cuda") * 0.5).to(torch.bfloat16) for _ in range(3)]
    _budget(monkeypatch, "off")
    want = []
    for a in inputs:
        x.copy_(a)
        want.append(chain())
    _budget(monkeypatch, "default")
    x.copy_(inputs[0])
    assert torch.equal(chain(), want[0])  # eager, and every build made before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = chain()
    for a, expect in zip(inputs, want):
        x.copy_(a)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
