"""The GEMM's two input forms (kernels/gpu/gemm.py `bmm`) on a GPU at the release's shapes:
- grouped inputs, KDA's f_b | g_b as one product over every local shard (4 virtual shards at TP 1): each shard's
  output is the bits of its own product, rows 1 / 8 / 64, decode and prompt rows;
- the SwiGLU read as the input loads (the shared expert's and the dense MLP's down projection, fp8 and bf16):
  within fp32 rounding of the SwiGLU kernel then the product (its activation tile is built in registers, not
  loaded: the compiler may pick other tensor-core instructions), and a row alone = among 64, bit for bit; eager
  = replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODE, PROMPT = 1 << 30, 0
SHARDS, RANK, HEAD_WIDTH = 4, 128, 8192  # KDA: 64 heads x 128, gates of rank 128, over 4 virtual shards
INTER, HIDDEN, LIMIT = 2048, 4096, 10.0  # the shared expert's down projection, per shard at TP 1


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def _down(fmt: str):
    from kernels.gpu import gemm, wtiles
    from kernels.quant import fp8
    w = _randn(SHARDS, HIDDEN, INTER // SHARDS, seed=3, scale=0.02)
    if fmt == "bf16":
        return gemm.dense(w)
    parts = [fp8.quantize_blocks(w[j].float()) for j in range(SHARDS)]
    return wtiles.quantized("fp8", {name: torch.stack([p[name] for p in parts]) for name in parts[0]},
                            {"block": fp8.DEFAULT_BLOCK})


@pytest.mark.parametrize("rows", [DECODE, PROMPT], ids=["decode", "prompt"])
def test_grouped_inputs_are_each_shards_own_product(rows: int) -> None:
    from kernels.gpu import gemm
    w = _randn(2 * SHARDS, HEAD_WIDTH // SHARDS, RANK, seed=1, scale=0.05)
    for t in (1, 8, 64):
        low = _randn(t, 2 * RANK, seed=2)
        pair = low.view(t, 2, RANK).transpose(0, 1)
        out = gemm.bmm(pair, w, rows, torch.float32)
        for j in range(2 * SHARDS):
            alone = gemm.matmul(pair[j // SHARDS].contiguous(), w[j], rows, torch.float32)
            assert torch.equal(out[j], alone), f"{t} rows, stacked shard {j}"


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_swiglu_input_rows_and_graph(fmt: str) -> None:
    from kernels.gpu import gemm, swiglu
    w = _down(fmt)
    i = INTER // SHARDS
    gate_up = _randn(SHARDS, 64, 2 * i, seed=4, scale=3.0)
    crowd = gemm.bmm(gate_up, w, DECODE, torch.float32, swiglu=LIMIT)
    apart = gemm.bmm(swiglu.swiglu(gate_up[..., :i], gate_up[..., i:], LIMIT), w, DECODE, torch.float32)
    torch.testing.assert_close(crowd, apart, rtol=1e-4, atol=1e-4)
    for t in (1, 8):
        assert torch.equal(gemm.bmm(gate_up[:, :t], w, DECODE, torch.float32, swiglu=LIMIT), crowd[:, :t])
    x = gate_up[:, :8].clone()
    eager = gemm.bmm(x, w, DECODE, torch.float32, swiglu=LIMIT)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = gemm.bmm(x, w, DECODE, torch.float32, swiglu=LIMIT)
    x.copy_(gate_up[:, 8:16])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, crowd[:, 8:16])
    x.copy_(gate_up[:, :8])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
